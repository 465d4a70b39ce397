"""Structured outputs' cost: the engine's generate throughput with a permissive constraint against none.

    make bench-structured          # or: PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/structured_bench.py

One engine in this process (the `llama-40m` preset, seed 0, with its tokenizer: a constraint needs one), the
plain workload of `make bench-peer` by default (random token ids, prompt lengths uniform in [16, 512], greedy,
float32), generated without a constraint and with a permissive one, alternately, `--repeats` times after one
untimed warm-up of each (compiles excluded). Permissive: every token of valid UTF-8 text is allowed
(`--constraint any-text`, regex `(?s:.*)`), or any JSON string (`--constraint json-string`, JSON Schema
`{"type": "string"}`; completions then end at the model's first closing quote, so their lengths differ).

Printed: output tokens/s of each and their ratio (target >= 0.8), and where the constrained run's extra time
goes: the host filling masks (llguidance), the device calls (a constrained step is a single step, so more calls
of one forward pass each: mean forward passes per call), and the rest of the host loop. On a shared 2-core
machine the numbers are noisy; report medians. `--decode-steps 1` runs the unconstrained side one decode step per
call too, which isolates the masks' own cost from the multi-step calls a constrained step gives up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine import Engine, EngineConfig, Request, SamplingConfig, write_model  # noqa: E402
from engine.sampling import structured  # noqa: E402 - the mask filling is timed by wrapping it

CONSTRAINTS = {"any-text": {"regex": r"(?s:.*)"}, "json-string": {"json_schema": {"type": "string"}}}


def timed_masks() -> list[float]:
    """Wrap Constraint.fill_masks so each call's seconds are appended to the returned list."""
    spent: list[float] = []
    fill = structured.Constraint.fill_masks

    def timed(constraints, mask):
        t0 = time.perf_counter()
        fill(constraints, mask)
        spent.append(time.perf_counter() - t0)

    structured.Constraint.fill_masks = staticmethod(timed)
    return spent


def run(engine: Engine, prompts: list[list[int]], sampling: SamplingConfig, masks: list[float]) -> dict:
    requests = [Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    masks.clear()
    t0 = time.perf_counter()
    records = engine.generate(requests, reset=True)  # the next run computes its prompts again: no prefix cache hit
    wall = time.perf_counter() - t0
    s = engine.stats.summary(engine.config.max_seqs)
    tokens = sum(len(r.token_ids) for r in records)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "device_s": s["device_s"],
            "host_s": s["host_s"], "calls": s["steps"], "model_steps": s["mean_model_steps"], "mask_s": sum(masks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="llama-40m")
    p.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="any-text")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps,
                   help="engine.decode_steps; 1 compares against single-step unconstrained decoding (the mask's own cost)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    model = write_model(args.preset, work / "model")
    rng = np.random.default_rng(0)
    engine = Engine(model, EngineConfig(max_seqs=args.max_seqs, max_prefill_size=1024, max_seqs_in_prefill=8,
                                        page_size=16, max_pages=args.max_seqs * ((args.max_len + args.new_tokens) // 16 + 1),
                                        max_seq_len=args.max_len + args.new_tokens, decode_steps=args.decode_steps))
    vocab = engine.vocab_size
    prompts = [rng.integers(6, vocab, int(n)).tolist()
               for n in rng.integers(args.min_len, args.max_len + 1, args.prompts)]
    plain = SamplingConfig(max_new_tokens=args.new_tokens)
    constrained = SamplingConfig(max_new_tokens=args.new_tokens, **CONSTRAINTS[args.constraint])
    masks = timed_masks()
    for sampling in (plain, constrained):  # compile every program either run needs
        run(engine, prompts[: args.max_seqs], sampling, masks)
    results: dict[str, list[dict]] = {"plain": [], "constrained": []}
    for _ in range(args.repeats):
        results["plain"].append(run(engine, prompts, plain, masks))
        results["constrained"].append(run(engine, prompts, constrained, masks))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"{args.preset}, engine.max_seqs={args.max_seqs}, engine.decode_steps={args.decode_steps}, constraint {args.constraint}, {args.repeats} repeats "
          "(medians)")
    for name in ("plain", "constrained"):
        print(f"  {name:12s} {med(name, 'tokens_per_s'):8.1f} tokens/s  ({med(name, 'tokens'):.0f} tokens in "
              f"{med(name, 'wall_s'):.2f} s; device calls {med(name, 'calls'):.0f} taking {med(name, 'device_s'):.2f} s, "
              f"{med(name, 'model_steps'):.2f} forward passes each; host {med(name, 'host_s'):.2f} s, of which "
              f"mask filling {med(name, 'mask_s'):.2f} s)")
    ratio = med("constrained", "tokens_per_s") / med("plain", "tokens_per_s")
    extra = med("constrained", "wall_s") - med("plain", "wall_s")
    print(f"ratio constrained / plain throughput: {ratio:.2f}x (target >= 0.8)")
    print(f"extra wall time {extra:+.2f} s: device calls {med('constrained', 'device_s') - med('plain', 'device_s'):+.2f} s, "
          f"mask filling {med('constrained', 'mask_s'):+.2f} s, other host work "
          f"{(med('constrained', 'host_s') - med('constrained', 'mask_s')) - med('plain', 'host_s'):+.2f} s")


if __name__ == "__main__":
    main()
