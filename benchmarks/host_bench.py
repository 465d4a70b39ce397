"""How much of the engine loop is host work, on a model whose device step is fast.

On a TPU a decode step of a large model takes milliseconds, the same order as the Python that schedules
it, feeds the sampled tokens to each sample's stop checker and builds the next step's inputs. This
reproduces that regime on a CPU with the `tiny-llama` preset (its steps take about a millisecond) and
times `Engine.generate` twice per case:
- once with each device call the runner makes timed from its call until its outputs are ready (the engine's
  `DeviceClock.serial` hook): the device time, and the host time beside it when nothing overlaps
  (scheduling, stop checks, detokenization, input packing, finishing samples);
- once as it runs: the loop's wall time, where the host's work overlaps device calls dispatched ahead
  (`engine.pipeline_decode`).

For each case it prints tokens/s of the loop, tokens/s the device calls alone would allow, and their
ratio (1.0: the host costs nothing). Cases: greedy with no stop strings, the same without pipelining,
greedy with a stop string (the text must then be watched token by token), and one decode step per device
call instead of `engine.decode_steps` (4). Every figure is the median over `--repeats` runs, the cases
interleaved.

Run from the repository root:
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/host_bench.py [--prompts 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from engine import Engine, EngineConfig, Request, SamplingConfig, write_model

CASES = {  # name: (stop strings, decode steps per device call, pipeline_decode)
    "no stop strings": ([], 4, True),
    "no stop strings, no pipelining": ([], 4, False),
    "a stop string": (["zqzq"], 4, True),  # never produced here: every token's text is decoded and searched
    "no stop strings, 1 step/call": ([], 1, True),
}



def _requests(num: int, stop: list[str], new_tokens: int) -> list[Request]:
    rng = np.random.default_rng(0)
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, stop=stop)
    return [Request(f"p{i}", tuple(rng.integers(10, 500, int(rng.integers(8, 64))).tolist()), sampling)
            for i in range(num)]


def run_case(model: Path, stop: list[str], decode_steps: int, pipeline: bool, num: int, new_tokens: int,
             engines: dict) -> dict:
    key = (decode_steps, pipeline)
    if key not in engines:
        engines[key] = Engine(model, EngineConfig(
            max_seqs=64, max_prefill_size=512, max_seqs_in_prefill=8, page_size=16, max_pages=2048,
            max_seq_len=max(256, 64 + new_tokens), decode_steps=decode_steps, pipeline_decode=pipeline))
        # The timed workload once, untimed: every shape bucket it uses is compiled before the first timing.
        engines[key].generate(_requests(num, stop, new_tokens), reset=True)
    engine = engines[key]
    result = {}
    for timing in (True, False):
        clock = engine.runner.clock  # the benchmarking hook: serial device time (engine/stats.py DeviceClock)
        clock.serial, before = timing, clock.total_s
        start = time.perf_counter()
        done = engine.generate(_requests(num, stop, new_tokens), reset=True)  # no prefix cache hit in the next
        result["serial" if timing else "wall"] = time.perf_counter() - start
        clock.serial = False
        if timing:
            result["device"] = clock.total_s - before
    errors = [c.error for c in done if c.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")
    result["tokens"] = sum(len(c.token_ids) for c in done)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    engines: dict = {}
    results: dict[str, list[dict]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(prefix="pagefleet-hostbench-") as tmp:
        model = write_model("tiny-llama", Path(tmp) / "tiny-llama")
        for _ in range(args.repeats):
            for name, (stop, steps, pipeline) in CASES.items():
                results[name].append(run_case(model, stop, steps, pipeline, args.prompts, args.new_tokens, engines))

    print(f"engine loop on tiny-llama: {args.prompts} prompts of 8-63 tokens, {args.new_tokens} new tokens, "
          f"greedy, 64 slots; medians of {args.repeats}")
    print("  device: the runner's device calls, each timed to its outputs; host: the rest of that timed run; wall: the loop "
          "untimed (host work overlapping calls dispatched ahead)")
    print(f"  {'case':32s} {'device s':>9s} {'host s':>7s} {'wall s':>7s} {'loop tok/s':>11s} "
          f"{'device tok/s':>13s} {'ratio':>6s}")
    for name, runs in results.items():
        wall = statistics.median(r["wall"] for r in runs)
        device = statistics.median(r["device"] for r in runs)
        host = statistics.median(r["serial"] - r["device"] for r in runs)
        tokens = runs[0]["tokens"]
        print(f"  {name:32s} {device:9.2f} {host:7.2f} {wall:7.2f} {tokens / wall:11.0f} "
              f"{tokens / device:13.0f} {device / wall:6.2f}")


if __name__ == "__main__":
    main()
