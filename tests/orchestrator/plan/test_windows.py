"""Planning in windows of rows (`corpus.window_rows`): every row in exactly one batch or in rejected.jsonl, ids unique
across windows (exactly, whatever their digests), packing within 3% of a one-window plan, and a plan killed between
windows plans the same on a rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from orchestrator.config import load_run_config
from orchestrator.plan import windows
from orchestrator.plan.planner import plan

ROOT = Path(__file__).resolve().parents[3]
ROWS = 3000
WINDOW = 800  # four windows: 800, 800, 800, 600 rows


def _corpus(path: Path) -> None:
    """Log-normal lengths, a prefix shared by every seventh row, a bad row and ids reused within and across windows."""
    rng = np.random.default_rng(5)
    words = ("alpha", "beta", "gamma", "delta", "river", "stone")
    lines = []
    for i in range(ROWS):
        text = " ".join(rng.choice(words, int(np.clip(rng.lognormal(2.0, 0.6), 1, 24))))
        lines.append({"id": f"p{i}", "prompt": ("shared opening words " * 4 + text) if i % 7 == 0 else text})
    lines[1000] = {"id": "p10", "prompt": "reuses the id of row 10, a window earlier"}
    lines[2500] = {"id": "p2400", "prompt": "reuses the id of row 2400, in its own window"}
    lines[1700] = {"id": "p1700"}  # no prompt: missing_field
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _args(tiny_model: str, corpus: Path, run_dir: Path, window_rows: int) -> list[str]:
    return [f"--run_dir={run_dir}", f"--corpus.path={corpus}", f"--model.path={tiny_model}", "--engine.max_seqs=16",
            "--engine.max_pages=256", "--engine.page_size=4", "--sampling.max_new_tokens=8",
            "--corpus.shard_bytes=20000", f"--corpus.window_rows={window_rows}"]


def _rows_of(run_dir: Path) -> tuple[dict[int, tuple[str, list[int]]], dict[int, str], dict[int, dict]]:
    """row -> (batch file, token ids) over every batch file; row -> reason over rejected.jsonl; row -> its rejection."""
    placed: dict[int, tuple[str, list[int]]] = {}
    for path in sorted((run_dir / "batches").glob("*.parquet")):
        for r in pq.read_table(path, columns=["row", "token_ids"]).to_pylist():
            assert r["row"] not in placed, f"row {r['row']} is in {placed[r['row']][0]} and in {path.name}"
            placed[r["row"]] = (path.name, r["token_ids"])
    rejected = [json.loads(line) for line in (run_dir / "rejected.jsonl").read_text().splitlines()]
    return placed, {r["row"]: r["reason"] for r in rejected}, {r["row"]: r for r in rejected}


def test_a_corpus_of_several_windows_has_every_row_once_and_packs_within_three_percent(tiny_model, tmp_path,
                                                                                        monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    whole = plan(load_run_config(None, _args(tiny_model, corpus, tmp_path / "whole", 1_000_000)))
    windowed = plan(load_run_config(None, _args(tiny_model, corpus, tmp_path / "windowed", WINDOW)))

    placed, reasons, rejections = _rows_of(tmp_path / "windowed")
    assert not set(placed) & set(reasons)
    assert sorted([*placed, *reasons]) == list(range(ROWS))  # every row once: in one batch or rejected
    assert reasons == {1000: "duplicate_id", 1700: "missing_field", 2500: "duplicate_id"}
    assert "already used by row 10" in rejections[1000]["detail"]  # found across windows, naming the first row
    assert "already used by row 2400" in rejections[2500]["detail"]
    # The same rows get the same tokens either way, and no batch mixes two windows.
    whole_placed, whole_reasons, _ = _rows_of(tmp_path / "whole")
    assert whole_reasons == reasons
    assert {r: t for r, (_, t) in placed.items()} == {r: t for r, (_, t) in whole_placed.items()}
    window_of_batch: dict[str, set[int]] = {}
    for row, (name, _) in placed.items():
        window_of_batch.setdefault(name, set()).add(row // WINDOW)
    assert all(len(w) == 1 for w in window_of_batch.values())
    assert len(window_of_batch) == windowed.stats.num_batches
    # The report counts the whole corpus either way; only the packing may differ.
    for name in ("rows_read", "accepted", "rejected", "total_prompt_tokens", "length_histogram", "lower_bound"):
        assert getattr(windowed.stats, name) == getattr(whole.stats, name), name
    print(f"\npacking efficiency, one window: {whole.stats.efficiency_ratio:.3f} ({whole.stats.num_batches} batches); "
          f"{-(-ROWS // WINDOW)} windows of {WINDOW} rows: {windowed.stats.efficiency_ratio:.3f} "
          f"({windowed.stats.num_batches} batches); lower bound {whole.stats.lower_bound}")
    assert windowed.stats.num_batches <= 1.03 * whole.stats.num_batches
    assert whole.stats.num_batches > 40  # enough batches for 3% to mean something

    # Digests only point to candidates: were every id's digest the same, the plan would not change.
    monkeypatch.setattr(windows, "_digests", lambda ids: np.zeros(len(ids), dtype=np.uint64))
    plan(load_run_config(None, _args(tiny_model, corpus, tmp_path / "colliding", WINDOW)))
    assert _plan_of(tmp_path / "colliding") == _plan_of(tmp_path / "windowed")


def _plan_of(run_dir: Path) -> dict[str, object]:
    batches = {p.name: pq.read_table(p).to_pylist() for p in sorted((run_dir / "batches").glob("*.parquet"))}
    return {"batches": batches, "manifest": (run_dir / "batches.jsonl").read_text(),
            "rejected": (run_dir / "rejected.jsonl").read_text()}


def test_a_plan_killed_between_windows_plans_the_same_on_a_rerun(tiny_model, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PAGEFLEET_CRASH_AT")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")

    def plan_command(run_dir: Path, crash_at: str | None) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "orchestrator", "plan", str(ROOT / "configs" / "demo.yaml"),
                   *_args(tiny_model, corpus, run_dir, WINDOW)]
        return subprocess.run(command, env={**env, **({"PAGEFLEET_CRASH_AT": crash_at} if crash_at else {})},
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)

    killed = plan_command(tmp_path / "run", "window_planned:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # A line a window, for a plan that takes minutes (on a terminal and under `ray job logs`).
    assert "plan: 3,000 rows in 4 windows of 800" in killed.stderr
    assert "plan: window 2/4 done: 1,600 rows" in killed.stderr and "window 3/4" not in killed.stderr
    assert len(list((tmp_path / "run" / "batches").glob("*.parquet"))) > 0  # two windows' batch files were left
    assert not (tmp_path / "run" / "batches.jsonl").exists()
    assert plan_command(tmp_path / "run", None).returncode == 0
    assert plan_command(tmp_path / "uninterrupted", None).returncode == 0
    placed, reasons, _ = _rows_of(tmp_path / "run")
    assert sorted([*placed, *reasons]) == list(range(ROWS))
    assert _plan_of(tmp_path / "run") == _plan_of(tmp_path / "uninterrupted")


def test_a_window_holds_window_rows_or_fewer_where_window_bytes_holds_fewer():
    from orchestrator.plan.corpus import CorpusConfig
    from orchestrator.plan.planner import window_rows

    assert window_rows(CorpusConfig(window_rows=800), 3000, 10**6) == 800  # short rows: the row cap
    assert window_rows(CorpusConfig(window_rows=800, window_bytes=30_000), 3000, 300_000) == 300  # 100 bytes a row
    assert window_rows(CorpusConfig(window_bytes=1), 3000, 300_000) == 1  # never empty
    assert window_rows(CorpusConfig(), 5, 0) == 1_000_000  # no size known (0 bytes listed): one window of 5 rows


def test_id_digests_are_equal_for_equal_ids_wherever_the_ids_sit_in_their_arrays():
    import pyarrow as pa

    ids = pa.array(["p1", "p2", "p1", "ab", "ba", "", "p1" * 300, "é", None] + [f"r{i}" for i in range(50_000)])
    digests = windows._digests(ids)
    assert digests[0] == digests[2] and digests[0] != digests[1] and digests[3] != digests[4]
    assert digests[5] == digests[8]  # a null reads as empty (rows without an id are rejected before this)
    assert len(set(digests[9:].tolist())) == 50_000
    assert windows._digests(ids.slice(2, 5)).tolist() == digests[2:7].tolist()  # an offset slice of a buffer
    chunked = pa.chunked_array([ids.slice(0, 4), ids.slice(4)])
    assert windows._digests(chunked).tolist() == digests.tolist()
    assert windows._digests(pa.array([], pa.string())).tolist() == []


def test_the_ids_of_earlier_windows_are_kept_on_disk_not_in_memory(tmp_path):
    """At 100M prompts the ids' digests and batches (12 bytes a prompt) were 1.2 GB of the head's memory: they are
    written per window to a temporary directory and read back a chunk at a time, and still find every reused id
    (checked against the batch file that holds it)."""
    import tracemalloc

    import pyarrow as pa

    from orchestrator.state.manifest import batch_id
    from orchestrator.storage.atomic import atomic_write_parquet

    n = 300_000
    ids = pa.array([f"id-{i}" for i in range(n)])
    batches = np.arange(n, dtype=np.int64) // 1000
    for b in (7, 250):  # the files the matches below are checked against
        rows = list(range(b * 1000, b * 1000 + 1000))
        atomic_write_parquet(tmp_path / f"{batch_id(b, n)}.parquet",
                             pa.table({"prompt_id": [f"id-{i}" for i in rows], "row": rows}), fsync=False)
    with windows.SeenIds(str(tmp_path), n) as seen:
        tracemalloc.start()
        seen.add(ids.slice(0, n // 2), batches[: n // 2])
        seen.add(ids.slice(n // 2), batches[n // 2:])
        held, _ = tracemalloc.get_traced_memory()
        later = pa.array(["new-0", "id-7001", "new-1", "id-250999"])
        assert seen.earlier_rows(later) == {1: 7001, 3: 250999}
        tracemalloc.stop()
        assert held < 100_000, f"{held:,} bytes held for {n:,} ids"  # was 12 bytes an id: 3.6 MB
        paths = [f"{path}.digests" for path, _ in seen.windows]
    assert not any(os.path.exists(p) for p in paths)  # removed when planning ends


def _shared_memory_kib() -> int:
    """This process's resident pages of shared memory (the object store's among them), in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


def test_a_plan_on_the_cluster_maps_no_object_store_pages_in_the_head_and_boots_no_process(tiny_model, tmp_path,
                                                                                           ray_local):
    """The head reads each window's summaries and sends its rows' batches in pieces Ray passes inline: it maps no page
    of the object store, whose pages (placed anew every window) added up in its RSS to as much as the store holds.
    And every task of the plan runs on the worker processes Ray keeps started, one a CPU: Ray Data's tokenizer actors
    booted processes of their own every window (seconds each on 2 cores)."""
    started = time.time()
    rows = 20_000
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "alpha beta " * (1 + i % 9)}) + "\n"
                              for i in range(rows)))
    args = [*_args(tiny_model, corpus, tmp_path / "run", 6_000), "--corpus.shard_bytes=100000",
            "--corpus.in_process_bytes=0"]  # on the cluster: four windows, several blocks each
    before = _shared_memory_kib()
    result = plan(load_run_config(None, args))
    grown = _shared_memory_kib() - before
    placed, reasons, _ = _rows_of(tmp_path / "run")
    assert sorted(placed) == list(range(rows)) and not reasons and result.stats.num_batches > 100
    # The summaries alone are ~1.5 MiB; what Ray itself puts (the shards' names, the tokenizer's settings) is a few
    # pages.
    assert grown < 256, f"the head mapped {grown} KiB of shared memory while planning"
    workers = _plan_workers(ray_local, started, windows=4)
    assert len(workers) <= 2, f"the plan's tasks ran in {len(workers)} processes on 2 CPUs: {sorted(workers)}"


def _plan_workers(ray, since: float, windows: int) -> set[str]:
    """The worker processes that ran the plan's tasks and actors since `since` (time.time()), read from Ray's timeline
    once it holds every window's last tasks, those that cut its blocks by batch (its events come every second or so)."""
    deadline = time.time() + 30
    while True:
        events = [e for e in ray.timeline() if e.get("ph") == "X" and e["ts"] >= since * 1e6]
        names = [e["name"] for e in events]
        if sum(n.endswith("split_block") for n in names) >= windows or time.time() > deadline:
            break
        time.sleep(1)
    assert sum(n.endswith("split_block") for n in names) >= windows, sorted(set(names))
    return {e["tid"] for e in events if str(e.get("tid", "")).startswith("worker:")}
