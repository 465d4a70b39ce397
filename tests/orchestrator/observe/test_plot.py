import pytest

import math

from orchestrator.observe.plot import by_slice, series, stopped_spans, total_tokens_per_s, write_plot

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


def resumed_timeline() -> list[dict]:
    """Two slices; the head stopped at t=10 and a new session started at t=500."""
    out = []
    for session, start in ((1000.0, 0.0), (2000.0, 500.0)):
        for s in range(2):
            out += [{"t": start + i + 0.1 * s, "slice": f"slice-{s}", "tokens_per_s": 50.0 + i, "occupancy": 0.5,
                     "session": session} for i in range(11)]
    return out


def test_a_resumed_runs_stopped_gap_is_not_drawn_at_the_last_rate():
    slices = by_slice(resumed_timeline())
    times, totals = total_tokens_per_s(slices)
    # Right after the last entry before the stop the total line breaks (NaN), then resumes at t=500.
    resumed = times.index(500.0)
    assert math.isnan(totals[resumed - 1]) and times[resumed - 1] == 10.1
    assert totals[resumed - 2] == 60.0 and totals[resumed] == 50.0  # slice-1's last rate, then slice-0's first
    assert stopped_spans(slices) == [(10.1, 500.0)]
    ts, rates = series(slices["slice-0"], "tokens_per_s")
    assert math.isnan(rates[11]) and ts[12] == 500.0  # each slice's own line breaks too


def test_a_timeline_without_sessions_breaks_at_a_long_silence():
    timeline = [{k: v for k, v in e.items() if k != "session"} for e in resumed_timeline()]
    assert stopped_spans(by_slice(timeline)) == [(10.1, 500.0)]


def test_the_plot_draws_the_summary_rate_and_says_why_it_differs_from_the_peak(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), real(self, *a, **k))[1])
    write_plot(tmp_path / "throughput.png", resumed_timeline(), mean_tokens_per_s=42.5)
    ax_rate = figures[0].axes[0]
    labels = [line.get_label() for line in ax_rate.lines]
    assert "summary: 42.5 tokens/s" in labels
    assert "wall time" in ax_rate.get_title()
    assert any(p.get_label() == "stopped" for p in ax_rate.patches)


def test_a_gs_run_directory_gets_its_plot(gcs_bucket):
    from orchestrator.state.rundir import RunDir
    from orchestrator.storage import storage
    from orchestrator.storage.location import location

    run_dir = RunDir(location(f"{gcs_bucket}/runs/r"))  # as the head holds a gs:// run directory
    write_plot(run_dir.plot, timeline(2))
    assert storage.read_bytes(f"{gcs_bucket}/runs/r/throughput.png")[:8] == PNG_SIGNATURE
