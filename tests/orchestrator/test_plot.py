import pytest

from orchestrator.plot import by_slice, total_tokens_per_s, write_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 0 and image.shape[1] > 0
    return image


def timeline(num_slices: int) -> list[dict]:
    return [{"t": 0.5 * i + 0.1 * s, "slice": f"slice-{s}", "tokens_per_s": 100.0 + 10 * s + i,
             "occupancy": min(1.0, 0.1 * i)} for s in range(num_slices) for i in range(12)]


@pytest.mark.parametrize("num_slices", [1, 3])
def test_write_plot_writes_a_png(tmp_path, num_slices):
    path = tmp_path / "plots" / "throughput.png"
    write_plot(path, timeline(num_slices))
    read_png(path)
    assert [p.name for p in path.parent.iterdir()] == ["throughput.png"]  # no temporary file left


def test_an_empty_timeline_still_writes_a_png(tmp_path):
    path = tmp_path / "throughput.png"
    write_plot(path, [])
    image = read_png(path)
    assert image.min() < 1.0  # the "no steps" text, not a blank page


def test_total_throughput_sums_the_slices_live_at_each_time():
    slices = by_slice([
        {"t": 0.0, "slice": "a", "tokens_per_s": 10.0, "occupancy": 0.5},
        {"t": 1.0, "slice": "b", "tokens_per_s": 5.0, "occupancy": 0.5},
        {"t": 2.0, "slice": "a", "tokens_per_s": 20.0, "occupancy": 0.5},
        {"t": 3.0, "slice": "b", "tokens_per_s": 7.0, "occupancy": 0.5},
    ])
    # b is not live at t=0; a has finished after t=2.
    assert total_tokens_per_s(slices) == ([0.0, 1.0, 2.0, 3.0], [10.0, 15.0, 25.0, 7.0])
