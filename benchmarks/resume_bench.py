"""How long a head takes to see where a big run stands: `status` and the resume (RunState.recover) over a synthetic
run directory of N one-prompt batches, half of them done, against the same at 10,000 batches, and of N batches 99%
done (a resume holds the batches still to do, not the done ones: its memory follows the first figure, not N).

The run directory is real files written with pagefleet's own writers: a batch file per batch, an output per done
batch (stamped for the plan, with its stats; every batch's are hard links to the first's, see write_run),
batches.jsonl and its digest, run.json. Each figure is measured in a fresh process (its peak RSS is the process's),
median of --repeats. Pass --keep DIR to write the run directories once and reuse them.

Run from the repository root:
    PYTHONPATH=$PWD python benchmarks/resume_bench.py [--batches 100000] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.plan.tokenized import BATCH_SCHEMA  # noqa: E402
from orchestrator.state.manifest import BatchRecord, batch_id, write_manifest  # noqa: E402
from orchestrator.state.output_plan import plan_fingerprint, stamp  # noqa: E402
from orchestrator.state.results import SAMPLE_SCHEMA, BatchStats, with_stats  # noqa: E402
from orchestrator.storage.atomic import atomic_write_parquet  # noqa: E402

FINGERPRINTS = {"config": "c", "corpus": "k", "tokenizer": "t", "model": "m", "weights": "w"}

MEASURE = """
import json, sys, time
from pathlib import Path
from orchestrator.observe.status import status
from orchestrator.state.output_plan import plan_fingerprint
from orchestrator.state.rundir import RunDir
from orchestrator.state.run_state import RunState
root, what = Path(sys.argv[1]), sys.argv[2]
start = time.perf_counter()
if what == "status":
    status(str(root))
else:
    plan = plan_fingerprint(json.loads((root / "run.json").read_text())["fingerprints"])
    RunState.recover(RunDir(root), 1, plan).close()
# VmHWM, not ru_maxrss: the latter survives fork and exec, so a child of a big parent reads the parent's peak
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"s": time.perf_counter() - start, "rss": peak / 1024}))
"""


def write_run(root: Path, batches: int, done_fraction: float = 0.5) -> None:
    """N one-prompt batches, the first `done_fraction` of them done. The first batch's file and output are written with pagefleet's
    writers; every other batch's are hard links to them (status and the resume read the files' names and sizes, never
    their contents), so a million batches take a minute to lay out, not two hours."""
    if (root / "batches.jsonl").exists():
        return
    (root / "batches").mkdir(parents=True, exist_ok=True)
    (root / "outputs").mkdir(exist_ok=True)
    plan = plan_fingerprint(FINGERPRINTS)
    first = batch_id(0, batches)
    template_batch, template_output = root / "batches" / f"{first}.parquet", root / "outputs" / f"{first}.parquet"
    atomic_write_parquet(template_batch, pa.table(
        {"prompt_id": ["p0"], "row": [0], "token_ids": [[1, 2, 3]], "passthrough": [None], "sampling": [None],
         "continuations": [None]},
        schema=BATCH_SCHEMA), fsync=False)
    row = {f.name: None for f in SAMPLE_SCHEMA} | {"prompt_id": "p0", "generation_index": 0, "row": 0,
                                                   "batch_id": first, "token_ids": [4], "completion": "x"}
    table = with_stats(pa.Table.from_pylist([row], schema=SAMPLE_SCHEMA), BatchStats(1, 1, 0.1, 1, 0.5, 1))
    atomic_write_parquet(template_output, stamp(table, plan, ["p0"]), fsync=False)
    output_bytes = template_output.stat().st_size
    link_batch, link_output = _linker(template_batch), _linker(template_output)
    records = []
    for b in range(batches):
        bid = batch_id(b, batches)
        if b:
            link_batch(root / "batches" / f"{bid}.parquet")
        if b < int(batches * done_fraction):
            if b:
                link_output(root / "outputs" / f"{bid}.parquet")
            records.append(BatchRecord(bid, "done", num_prompts=1, num_prompt_tokens=3, output=f"outputs/{bid}.parquet",
                                       num_samples=1, num_output_tokens=1, output_bytes=output_bytes))
        else:
            records.append(BatchRecord(bid, num_prompts=1, num_prompt_tokens=3))
    (root / "run.json").write_text(json.dumps({"fingerprints": FINGERPRINTS, "sample_affecting": {"sampling": {"n": 1}},
                                               "plan": {"accepted": batches, "rows_read": batches}}))
    write_manifest(root / "batches.jsonl", records)


def _linker(template: Path):
    """A function that makes its path a hard link to `template`, or to a copy of it once a file has 60,000 links (ext4
    allows 65,000)."""
    source, count = [template], [0]

    def link(path: Path) -> None:
        if count[0] == 60_000:
            source[0], count[0] = path, 0
            shutil.copyfile(template, path)
            return
        os.link(source[0], path)
        count[0] += 1

    return link


def measure(root: Path, what: str) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(root), what], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="write the run directories here and reuse them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagefleet-resumebench-") as tmp:
        base = args.keep or Path(tmp)
        cases = sorted({(10_000, 0.5), (args.batches, 0.5), (args.batches, 0.99)})
        for n, done in cases:
            write_run(base / _name(n, done), n, done)
        print(f"status and resume of a run directory of one-prompt batches; medians of {args.repeats}")
        print(f"  {'batches':>9s} {'done':>5s} {'status s':>9s} {'RSS MiB':>8s} {'resume s':>9s} {'RSS MiB':>8s}")
        for n, done in cases:
            runs = {what: [measure(base / _name(n, done), what) for _ in range(args.repeats)]
                    for what in ("status", "resume")}
            med = {what: (statistics.median(r["s"] for r in rs), statistics.median(r["rss"] for r in rs))
                   for what, rs in runs.items()}
            print(f"  {n:9,d} {done:5.0%} {med['status'][0]:9.2f} {med['status'][1]:8.0f} {med['resume'][0]:9.2f} "
                  f"{med['resume'][1]:8.0f}")


def _name(batches: int, done_fraction: float) -> str:
    return f"run-{batches}" if done_fraction == 0.5 else f"run-{batches}-done{round(done_fraction * 100)}"


if __name__ == "__main__":
    main()
