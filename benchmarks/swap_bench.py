"""Swap preemption against recompute on a long-generation workload: `pagefleet generate`, whole process.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/swap_bench.py

128 prompts (random token ids, 16-64 tokens: `--min-prompt`, `--max-prompt`) each asking for 512-1,024 new tokens (its own
`sampling.max_new_tokens`, uniform, fixed seed), greedy, on a preset checkpoint (`tiny-llama` by default;
`--preset llama3-shaped` is a 126M model with Llama-3-8B's proportions, see `llama3_shaped`). The
device pool (`engine.max_pages`) is `--pool-fraction` (default one half) of what `engine.max_seqs` sequences of
the mean requested length need, so the scheduler preempts all along (a random-weight model stops some samples
early at EOS: their tokens are counted, not hidden). Each side is one `pagefleet generate` process
(python start, imports, model load, compile from the shared compile cache, run, write), interleaved
`--repeats` times after one untimed run of each that fills the compile cache:

- `recompute`: `--engine.preemption=recompute` (what the engine did before the host KV tier);
- `swap`: `--engine.preemption=swap --engine.host_kv_pages=<--host-pages, default 4x the device pool>`.

Printed: each side's median wall time and output tokens/s, their ratio (goal: swap at least 1.3x faster), the
bytes the swaps moved each way (the transfer ledger's `swap` category), the pages moved, the tokens recomputed
and the recomputes avoided, and whether every sample's tokens are the same on both sides (they must be).
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
sys.path.insert(0, str(ROOT))


def llama3_shaped() -> "Preset":
    """A 126M-parameter model with Llama-3-8B's proportions: KV width a quarter of the hidden size (2 KV heads of
    128), MLP 3.5x the hidden size, vocabulary about 7% of the parameters. KV bytes per token over FLOPs per token
    fall as models grow: llama-40m's ratio is 4x this model's and 17x Llama-3-8B's. A KV-heavy model reads more
    bytes per generated token, which makes a recomputed token cheap next to a generated one; this shape is the
    nearer test of what swap saves on a real model."""
    from engine import Preset

    return Preset("llama", hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, vocab_size=8192, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0)


BENCH_SHAPES = {"llama3-shaped": llama3_shaped}
"""`--preset` names this benchmark adds to the built-in presets."""


def write_inputs(work: Path, preset: str, num_prompts: int, prompt_lens: tuple[int, int], min_new: int, max_new: int,
                 seed: int) -> tuple[Path, Path]:
    import numpy as np

    from engine import write_model

    model = work / preset
    if not (model / "model.safetensors").exists():
        write_model(BENCH_SHAPES[preset]() if preset in BENCH_SHAPES else preset, model, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(num_prompts):
        prompt = rng.integers(2, vocab, int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))).tolist()
        lines.append(json.dumps({"id": str(i), "prompt_token_ids": prompt,
                                 "sampling": {"max_new_tokens": int(rng.integers(min_new, max_new + 1))}}) + "\n")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(lines))
    return model, prompts


def run_generate(model: Path, prompts: Path, out: Path, flags: list[str]) -> tuple[float, dict, dict]:
    """One whole `pagefleet generate` process: (wall s, its --stats_output, {prompt id: token ids})."""
    stats = out.with_suffix(".stats.json")
    cmd = [sys.executable, "-m", "orchestrator", "generate", "--model", str(model), "--input", str(prompts),
           "--output", str(out), "--stats_output", str(stats), "--progress=false", *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"pagefleet generate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    tokens = {r["prompt_id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return wall, json.loads(stats.read_text()), tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-llama", help=f"a built-in preset or {', '.join(BENCH_SHAPES)}")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16, help="prompt tokens, drawn uniformly")
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--min-new", type=int, default=512)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p.add_argument("--host-pages", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--engine-flags", default="", help="more `--engine.*` flags for both sides")
    p.add_argument("--work", default="/tmp/pagefleet-swap-bench")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompt_lens = (args.min_prompt, args.max_prompt)
    model, prompts = write_inputs(work, args.preset, args.prompts, prompt_lens, args.min_new, args.max_new, seed=0)
    max_len = args.max_prompt + args.max_new
    mean_len = (args.min_prompt + args.max_prompt) // 2 + (args.min_new + args.max_new) // 2
    need = args.max_seqs * -(-mean_len // args.page_size)
    pool = max(int(need * args.pool_fraction), -(-max_len // args.page_size))
    host = args.host_pages if args.host_pages is not None else 4 * pool
    common = [f"--engine.max_seq_len={max_len}", f"--engine.page_size={args.page_size}", f"--engine.max_pages={pool}",
              f"--engine.max_seqs={args.max_seqs}", *args.engine_flags.split()]
    sides = {"recompute": common + ["--engine.preemption=recompute"],
             "swap": common + ["--engine.preemption=swap", f"--engine.host_kv_pages={host}"]}
    print(f"{args.prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.min_new}-{args.max_new} new tokens, "
          f"{args.preset}; device pool {pool} pages "
          f"of {args.page_size} ({args.pool_fraction:.0%} of {need} for {args.max_seqs} sequences of {mean_len}); "
          f"host pool {host} pages", flush=True)
    walls: dict[str, list[float]] = {s: [] for s in sides}
    last: dict[str, tuple[dict, dict]] = {}
    for repeat in range(args.repeats + 1):  # the first round fills the compile cache: not timed
        for side, flags in sides.items():
            wall, stats, tokens = run_generate(model, prompts, work / f"{side}.jsonl", flags)
            if repeat:
                walls[side].append(wall)
            last[side] = stats, tokens
            print(f"  {'warm-up' if not repeat else f'repeat {repeat}'} {side}: {wall:.1f} s", flush=True)
    (rs, rt), (ss, st) = last["recompute"], last["swap"]
    out_tokens = sum(len(t) for t in st.values())
    for side, (stats, _) in last.items():
        w = statistics.median(walls[side])
        print(f"{side:9s}  {w:8.1f} s whole process, {out_tokens / w:8.1f} output tokens/s; {stats['num_preemptions']} "
              f"preemptions, {stats['recompute_tokens']:,} computed tokens dropped for recompute")
    ratio = statistics.median(walls["recompute"]) / statistics.median(walls["swap"])
    print(f"swap / recompute speed: {ratio:.2f}x (goal >= 1.3x)")
    print(f"swap moved {ss['kv_pages_out']:,} pages out ({ss['device_to_host_bytes_swap']:,} B) and "
          f"{ss['kv_pages_in']:,} in ({ss['host_to_device_bytes_swap']:,} B); recompute of "
          f"{ss['recompute_avoided_tokens']:,} tokens avoided; host pool peak {ss['host_kv_pages_peak']:,} of {host} "
          f"pages; {ss['num_swap_fallbacks']} fallbacks to recompute")
    print(f"tokens identical on both sides: {rt == st} ({out_tokens:,} output tokens)")


if __name__ == "__main__":
    main()
