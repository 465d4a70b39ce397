"""Export at scale: the bounded-memory sort against one in-memory sort, on the same synthetic run.

    python benchmarks/export_bench.py --samples 1000000 --memory-gb 0.25 --repeats 3

Builds a run directory of done batches whose corpus rows are shuffled across batches (as longest-first
packing leaves them; ~1 KB per sample: a few hundred characters of completion and ~100 token ids), then
runs `pagefleet export` in a fresh process per repeat, alternately with a budget so large that it sorts
everything in memory (what export did before it had a budget) and with `--memory-gb`. Prints the median
wall time and peak RSS of each and their ratios, and checks that both outputs are identical.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The peak from VmHWM, not ru_maxrss: the latter survives fork and exec, so a child of this process (which made a
# run directory of a million samples first) would read this process's peak.
RSS = ("import sys, runpy; sys.argv = ['pagefleet', *sys.argv[1:]]\n"
       "try:\n    runpy.run_module('orchestrator', run_name='__main__')\n"
       "finally:\n    print('maxrss_kb', next(int(line.split()[1]) for line in open('/proc/self/status')\n"
       "                                 if line.startswith('VmHWM:')), file=sys.stderr)\n")


def make_run(root: Path, num_samples: int, per_batch: int, seed: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.state.manifest import BatchRecord, batch_id, write_manifest
    from orchestrator.state.results import SAMPLE_SCHEMA

    rng = np.random.default_rng(seed)
    rows = rng.permutation(num_samples)
    num_batches = -(-num_samples // per_batch)
    (root / "outputs").mkdir(parents=True)
    alphabet = np.frombuffer(b"abcdefghij klmnop", dtype=np.uint8)
    records = []
    for b in range(num_batches):
        bid = batch_id(b, num_batches)
        r = rows[b * per_batch:(b + 1) * per_batch]
        n = len(r)
        lens = rng.integers(100, 900, n)
        text = alphabet[rng.integers(0, len(alphabet), int(lens.sum()))].tobytes()
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        completion = pa.StringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(text))
        tl = rng.integers(20, 200, n)
        tokens = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(tl)]).astype(np.int32)),
                                          pa.array(rng.integers(0, 50_000, int(tl.sum())).astype(np.int32)))
        given = {"prompt_id": pa.array([f"doc-{x}" for x in r]), "generation_index": np.zeros(n, np.int32),
                 "completion": completion, "token_ids": tokens, "finish_reason": pa.array(["stop"] * n),
                 "num_prompt_tokens": np.full(n, 7, np.int32), "batch_id": pa.array([bid] * n),
                 "row": r.astype(np.int64)}
        table = pa.table({f.name: given.get(f.name, pa.nulls(n, f.type)) for f in SAMPLE_SCHEMA},  # the rest null
                         schema=SAMPLE_SCHEMA)
        pq.write_table(table, root / "outputs" / f"{bid}.parquet")
        records.append(BatchRecord(bid, status="done", output=f"outputs/{bid}.parquet", num_samples=n))
    write_manifest(root / "batches.jsonl", records)


def run_export(run_dir: Path, output: Path, memory_gb: float) -> tuple[float, float]:
    """(wall s, peak RSS GiB) of one `pagefleet export` process."""
    cmd = [sys.executable, "-c", RSS, "export", str(run_dir), f"--output={output}", f"--memory-gb={memory_gb}",
           "--no-progress"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(next(line.split()[1] for line in proc.stderr.splitlines() if line.startswith("maxrss_kb")))
    return wall, rss_kb / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--per-batch", type=int, default=2500)
    ap.add_argument("--memory-gb", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ap.add_argument("--workdir", default="/tmp/pagefleet-exportbench")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import shutil

    import pyarrow.parquet as pq

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    run_dir = work / "run"
    make_run(run_dir, args.samples, args.per_batch, args.seed)
    size = sum(f.stat().st_size for f in (run_dir / "outputs").iterdir())
    print(f"{args.samples:,} samples in {-(-args.samples // args.per_batch):,} batches, {size / 2**30:.2f} GiB of "
          f"parquet; {args.format}; {os.cpu_count()} cores")
    results: dict[str, list[tuple[float, float]]] = {"in memory": [], "bounded": []}
    outputs = {"in memory": work / f"in-memory.{args.format}", "bounded": work / f"bounded.{args.format}"}
    budgets = {"in memory": 1024.0, "bounded": args.memory_gb}
    for _ in range(args.repeats):
        for name in results:
            results[name].append(run_export(run_dir, outputs[name], budgets[name]))
    med = {name: (statistics.median(w for w, _ in r), statistics.median(m for _, m in r)) for name, r in results.items()}
    for name, (wall, rss) in med.items():
        print(f"  {name:10s} --memory-gb={budgets[name]:<7g} {wall:6.1f} s  peak RSS {rss:5.2f} GiB   "
              f"(runs: {', '.join(f'{w:.1f} s / {m:.2f} GiB' for w, m in results[name])})")
    print(f"  RATIO bounded / in memory: time {med['bounded'][0] / med['in memory'][0]:.2f}, "
          f"peak RSS {med['bounded'][1] / med['in memory'][1]:.2f}")
    if args.format == "parquet":
        same = pq.read_table(outputs["bounded"]).equals(pq.read_table(outputs["in memory"]))
    else:
        same = outputs["bounded"].read_bytes() == outputs["in memory"].read_bytes()
    print(f"  outputs identical: {same}")
    shutil.rmtree(work, ignore_errors=True)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
