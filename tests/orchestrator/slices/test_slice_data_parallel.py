"""A data-parallel slice in one process (no Ray): `cluster.mesh: {data: D, model: T}` runs D engines on T devices
each, every one taking batches from the slice's inbox; the samples are those of one engine, each exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig, SamplingConfig
from orchestrator.state.results import Completed
from orchestrator.slices.slice import SliceSpec, SliceWorker

from .test_slice import batch, poll_until_done

SAMPLING = SamplingConfig(max_new_tokens=12, n=2, temperature=0.8, top_p=0.9, seed=3, logprobs=True)
BATCHES = {f"b{i}": 3 for i in range(6)}


def run_slice(model: str, directory: Path, mesh: dict[str, int], budget: int | None = None) -> tuple[dict, SliceWorker]:
    """Every batch sent at once; with a `budget`, each carries the head's wake mark (SliceGang.submit)."""
    engine = EngineConfig(page_size=8, max_pages=96, max_seqs=4, max_seqs_in_prefill=4, max_prefill_size=64,
                          max_seq_len=128)
    w = SliceWorker(SliceSpec("slice-t", model, model, "float32", engine, SAMPLING, mesh=mesh))
    w.start()
    try:
        sent = 0
        for seq, (batch_id, prompts) in enumerate(BATCHES.items()):
            sent += prompts * SAMPLING.n
            w.submit(batch(directory, batch_id, seq, prompts, wake_at=None if budget is None else sent - budget + 1))
        got, finished = poll_until_done(w, set(BATCHES))
    finally:
        w.stop()
    assert all(isinstance(r, Completed) for r in got) and finished == sum(BATCHES.values()) * SAMPLING.n
    samples = {}
    for r in got:
        t = r.samples.to_pydict()
        for pid, g, tokens, logprobs in zip(t["prompt_id"], t["generation_index"], t["token_ids"], t["logprobs"]):
            assert (pid, g) not in samples, "a sample returned twice"
            samples[(pid, g)] = (tokens, logprobs)
    return {"samples": samples, "timeline": [b for r in got for b in r.timeline]}, w


@pytest.fixture(scope="module")
def one_engine(run_model, tmp_path_factory):
    out, _ = run_slice(run_model, tmp_path_factory.mktemp("one"), {"model": 1})
    return out


@pytest.mark.parametrize("mesh", [{"data": 2, "model": 1}, {"data": 2, "model": 2}])
def test_data_parallel_engines_sample_as_one_engine(run_model, one_engine, mesh, tmp_path):
    out, w = run_slice(run_model, tmp_path, mesh, budget=8)
    assert out["samples"].keys() == one_engine["samples"].keys()
    for key, (tokens, logprobs) in one_engine["samples"].items():
        assert out["samples"][key][0] == tokens, key
        if mesh["model"] == 1:  # row tiles (engine/device/row_tiles.py): a row's bits never depend on the rows beside it
            assert out["samples"][key][1] == logprobs, key
        else:  # sharded contractions (T=2) sum in another order: 1e-4
            assert out["samples"][key][1] == pytest.approx(logprobs, abs=1e-4, rel=0), key
    # Every engine took batches, on its own devices; the timeline says which engine took each step.
    assert len(w._lanes) == 2 and all(lane.steps > 0 for lane in w._lanes)
    devices = [{d.id for d in lane.engine.runner.kv.pool.array.devices()} for lane in w._lanes]
    assert not devices[0] & devices[1] and all(len(d) == mesh["model"] for d in devices)
    assert {b["engine"] for b in out["timeline"]} == {0, 1}
    assert sum(b["steps"] for b in out["timeline"]) == w.total_steps
