"""Two revisions of pagefleet side by side: `pagefleet generate` from each, alternated, on bench-peer's workloads.

    make bench-ab BASE=origin/main          # or: python benchmarks/ab_bench.py --base REV [--new REV] --repeats 3

A change that should not slow the engine down (a restructure, a host-side fix) is checked with this: each
revision is checked out into a detached worktree of its own under `.peer/ab/` (`--new` defaults to the working
tree itself, uncommitted changes included), and both run the same inputs as `make bench-peer` (the llama-40m
preset without EOS, token-id prompts, greedy, 64 new tokens: `peer_bench.write_model` and `write_workloads`)
as whole `pagefleet generate` processes with that tree first on `PYTHONPATH`. One untimed run per revision and
workload fills each side's compile cache; then the timed runs alternate (base, new, base, new, ...) so that a
machine that slows down or speeds up during the run weighs on both sides alike. Printed per workload: the
median wall time of each side, new / base speed (> 1: the new revision is faster), the engine loop's time and
steps on each side, and on how many prompts the two revisions gave identical tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import PEER, first_differences, read_tokens, write_model, write_workloads  # noqa: E402


def generate(tree: Path, model: Path, prompts: Path, out: Path, stats: Path, new_tokens: int,
             env: dict[str, str]) -> tuple[float, dict]:
    """One whole `pagefleet generate` process of `tree` (run from it: `-m` puts the working directory first)."""
    cmd = [sys.executable, "-m", "orchestrator", "generate", f"--model={model}", f"--input={prompts}",
           f"--output={out}", f"--sampling.max_new_tokens={new_tokens}", "--sampling.temperature=0",
           "--progress=false", f"--stats_output={stats}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, json.loads(stats.read_text())


def checkout(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` at `where` (made once; moved to `rev` when it already exists)."""
    if where.exists():
        subprocess.run(["git", "-C", str(where), "checkout", "-q", "--detach", rev], check=True)
    else:
        where.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where), rev], check=True)
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the revision to compare against (a commit, branch or tag)")
    p.add_argument("--new", default=None, help="the revision under test (default: this working tree as it is)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default="plain,shared-prefix")
    args = p.parse_args()

    base_sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.base], check=True, capture_output=True,
                              text=True).stdout.strip()
    trees = {"base": checkout(base_sha, PEER / "ab" / "base")}
    trees["new"] = ROOT if args.new is None else checkout(args.new, PEER / "ab" / "new")
    work = PEER / "work" / f"ab-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    workloads = write_workloads(work, vocab, args.seed)
    envs = {side: {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(tree),
                   "PAGEFLEET_COMPILE_CACHE": str(work / f"xla-{side}")} for side, tree in trees.items()}
    print(f"base {args.base} ({base_sha[:10]}) at {trees['base']}; new {args.new or 'the working tree'} at {trees['new']}",
          flush=True)

    for name in args.workloads.split(","):
        prompts_path, prompts = workloads[name]
        print(f"\n== {name}: {len(prompts)} prompts, {sum(map(len, prompts)):,} prompt tokens, "
              f"{args.new_tokens} new tokens each, {args.repeats} alternated repeats", flush=True)
        out = {side: work / f"{name}.{side}.jsonl" for side in trees}
        stats = {side: work / f"{name}.{side}.stats.json" for side in trees}
        for side in trees:  # untimed: fills this side's compile cache
            generate(trees[side], model, prompts_path, out[side], stats[side], args.new_tokens, envs[side])
        walls: dict[str, list[float]] = {side: [] for side in trees}
        last: dict[str, dict] = {}
        for repeat in range(args.repeats):
            for side in (("base", "new") if repeat % 2 == 0 else ("new", "base")):
                wall, last[side] = generate(trees[side], model, prompts_path, out[side], stats[side],
                                            args.new_tokens, envs[side])
                walls[side].append(wall)
                print(f"  {side:4} {wall:6.1f} s", flush=True)
        for side in trees:
            s = last[side]
            print(f"  {side:4} median {statistics.median(walls[side]):6.1f} s  (runs "
                  f"{', '.join(f'{w:.1f}' for w in walls[side])}; engine loop {s.get('wall_s', 0):.1f} s, "
                  f"{s.get('steps')} steps)")
        print(f"  SPEED new / base: {statistics.median(walls['base']) / statistics.median(walls['new']):.2f}x  "
              f"(> 1: the new revision is faster)")
        a, b = read_tokens(out["base"]), read_tokens(out["new"])
        print(f"  tokens identical on {sum(a[k] == b.get(k) for k in a)}/{len(a)} prompts")
        for line in first_differences(a, b, ("base", "new")):
            print(f"    {line}")


if __name__ == "__main__":
    main()
