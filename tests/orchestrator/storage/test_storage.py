"""The storage layer on a local directory and on a real Cloud Storage emulator (fake-gcs-server, loopback)."""

import pytest

from orchestrator.storage import generations, storage


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("gcs_bucket") + "/run"


def test_write_read_list_remove(root):
    storage.makedirs(storage.join(root, "outputs"))
    assert storage.list_names(storage.join(root, "outputs"), ".parquet") == []
    assert not storage.exists(storage.join(root, "outputs", "b1.parquet"))
    for name in ("b1.parquet", "b0.parquet", "notes.txt"):
        storage.write_atomic(storage.join(root, "outputs", name), name.encode())
    storage.write_atomic(storage.join(root, "outputs", "b0.parquet"), b"replaced")
    assert storage.list_names(storage.join(root, "outputs"), ".parquet") == ["b0.parquet", "b1.parquet"]
    assert storage.read_bytes(storage.join(root, "outputs", "b0.parquet")) == b"replaced"
    with storage.open_file(storage.join(root, "outputs", "b1.parquet")) as f:
        f.seek(3)
        assert f.read(4) == b"parq"
    storage.remove(storage.join(root, "outputs", "b0.parquet"))
    storage.remove(storage.join(root, "outputs", "b0.parquet"))  # already gone: fine
    assert storage.list_names(storage.join(root, "outputs"), ".parquet") == ["b1.parquet"]


def test_join_keeps_url_and_path_forms(tmp_path):
    assert storage.join("gs://b/run/", "outputs", "x.parquet") == "gs://b/run/outputs/x.parquet"
    assert storage.join(str(tmp_path), "outputs") == str(tmp_path / "outputs")
    assert storage.is_object_store("gs://b/x") and not storage.is_object_store(str(tmp_path))


def test_generation_compare_and_swap_on_the_emulator(gcs_bucket):
    url = f"{gcs_bucket}/run/batches.jsonl"
    assert generations.read_with_generation(url) is None
    g1 = generations.create_if_absent(url, b"one")
    with pytest.raises(generations.PreconditionFailed, match="no object"):
        generations.create_if_absent(url, b"two")  # a second creator loses
    assert generations.read_with_generation(url) == (b"one", g1)
    g2 = generations.replace_if_generation(url, b"two", g1)
    assert g2 != g1
    with pytest.raises(generations.PreconditionFailed, match=f"generation {g1}"):
        generations.replace_if_generation(url, b"stale writer", g1)  # wrote against an old generation: refused
    assert storage.read_bytes(url) == b"two"  # and nothing was clobbered
    assert generations.object_info(url)["generation"] == g2
    # (fake-gcs-server does not check a delete's precondition, so only the delete itself is tested here.)
    generations.delete_if_generation(url, g2)
    assert not storage.exists(url)


def test_a_write_from_another_process_is_seen(gcs_bucket):
    """No listing cache: what another process wrote (a head, seen from `status`) is visible at once."""
    import subprocess
    import sys

    url = f"{gcs_bucket}/run/progress.json"
    assert not storage.exists(url)
    subprocess.run([sys.executable, "-c", f"from orchestrator.storage import storage; storage.write_atomic({url!r}, b'x')"],
                   check=True)
    assert storage.exists(url) and storage.list_names(f"{gcs_bucket}/run") == ["progress.json"]
