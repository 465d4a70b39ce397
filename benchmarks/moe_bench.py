"""A tiny mixture of experts against its dense twin (the same attention, a dense MLP as wide as the k active experts
together): tokens/s of a prefill step and of a decode step, and each step's MLP FLOPs, for E experts and top-k.

The prefill step has the CPU's step size (engine.max_prefill_size as `pagefleet generate` sizes it: 4,096 tokens) in
sequences of 512 tokens; the decode step, 64 rows (the CPU's slots) one token each after 512 cached ones.

The MoE's FLOPs are counted, not read from XLA's cost analysis (which counts a loop body once). On the CPU
(engine/models/moe.py) each expert multiplies a prompt token's pairs padded to a multiple of 32 rows, at least 64, so a
prefill step of T tokens computes `sum_e max(64, ceil(n_e / 32) * 32)` expert rows over the experts chosen, at most
`T * k + E * 63` (every expert chosen by one token). A generated token's pairs run in the native CPU kernels'
grouped matmul, which computes a decode step of R rows in exactly `R * k` expert rows; without the native kernels,
in XLA matmuls of exactly 8 rows: `sum_e ceil(n_e / 8) * 8` rows, at most `R * k + E * 7`. The router adds
`2 * T * H * E`. The dense twin computes `T` rows of a `k * I`-wide MLP. The figures printed are the bounds, so they
err against the MoE.

Every model's steps are compiled first; then the models' steps alternate, `--reps` rounds, and the medians are
printed. Run from the repository root (about a minute):
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/moe_bench.py [--experts 8 32] [--top-k 2] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.device.runner import CPU_MIN_MATMUL_ROWS, ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.moe import GENERATED_TILE_ROWS
from engine.models.presets import Preset, write_model
from engine.models.weights import load_transformer
from engine.sizing.machine_sizing import STEP_TOKENS

HIDDEN, EXPERT_SIZE, LAYERS, PAGE_SIZE = 256, 256, 4, 16


def preset(experts: int, top_k: int) -> Preset:
    """A Mixtral of `experts` experts (top-k), or with experts=0 its dense twin (a Llama with a k-expert-wide MLP)."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6)
    if experts == 0:
        return Preset("llama", intermediate_size=top_k * EXPERT_SIZE, **common)
    return Preset("mixtral", intermediate_size=EXPERT_SIZE, num_experts=experts, experts_per_token=top_k,
                  expert_size=EXPERT_SIZE, **common)


def mlp_flops(tokens: int, experts: int, top_k: int, tile: int) -> int:
    """Multiply-adds x 2 of one step's MLPs (every layer); for the MoE the bound above, for expert matmuls of
    multiples of `tile` rows."""
    if experts == 0:
        return LAYERS * 2 * tokens * 3 * HIDDEN * top_k * EXPERT_SIZE
    rows = tokens * top_k + experts * (tile - 1)
    return LAYERS * (2 * rows * 3 * HIDDEN * EXPERT_SIZE + 2 * tokens * HIDDEN * experts)


def step_runners(path: Path, tokens: int, seq_tokens: int, decode_rows: int):
    """Timed steps of one model, each compiled and run once: a prefill step of `tokens` tokens (sequences of
    `seq_tokens`), and a decode step of `decode_rows` sequences of one new token each after `seq_tokens` cached ones."""
    seqs = tokens // seq_tokens
    decode_pages = -(-(seq_tokens + 1) // PAGE_SIZE)
    config = EngineConfig(page_size=PAGE_SIZE, max_pages=max(tokens // PAGE_SIZE, decode_rows * decode_pages) + 8,
                          max_prefill_size=tokens, max_seqs=max(seqs, decode_rows))
    runner = ModelRunner(load_transformer(path), RunnerConfig.of(config), max_seq_len=seq_tokens + 1)
    native = runner.attention_impl == "cpu_kernel"  # generated tokens' experts in the native grouped matmul
    per_seq_pages = seq_tokens // PAGE_SIZE
    prefill = [SeqChunk([7 + (i * 13 + j) % 500 for j in range(seq_tokens)], 0,
                        list(range(i * per_seq_pages, (i + 1) * per_seq_pages))) for i in range(seqs)]
    # Each decode row feeds a token it generated (its prompt was the `seq_tokens` before it), as the engine's do.
    decode = [SeqChunk([7 + i % 500], seq_tokens, list(range(i * decode_pages, (i + 1) * decode_pages)), seq_tokens)
              for i in range(decode_rows)]

    def timed(chunks):
        runner.logits(chunks)

        def step() -> float:
            t0 = time.perf_counter()
            runner.logits(chunks)
            return time.perf_counter() - t0
        return step
    return timed(prefill), timed(decode), native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=STEP_TOKENS["cpu"],
                        help="tokens in the timed prefill step (default: the CPU's step, engine.max_prefill_size as "
                             "`pagefleet generate` sizes it)")
    parser.add_argument("--seq-tokens", type=int, default=512, help="tokens of each prefill sequence")
    parser.add_argument("--decode-rows", type=int, default=64, help="sequences in the timed decode step")
    parser.add_argument("--reps", type=int, default=15, help="timed steps of each model, alternated")
    args = parser.parse_args()
    k, tokens = args.top_k, args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        # Every model's steps are built first, then the steps alternate round by round (the machine's speed drifts).
        models = [0, *args.experts]
        steps = {e: step_runners(write_model(preset(e, k), Path(tmp) / f"moe{e}"), tokens, args.seq_tokens,
                                 args.decode_rows) for e in models}
        times: dict[tuple[int, int], list[float]] = {(e, kind): [] for e in models for kind in (0, 1)}
        for _ in range(args.reps):
            for e in models:
                for kind in (0, 1):
                    times[e, kind].append(steps[e][kind]())
        seconds = {key: statistics.median(t) for key, t in times.items()}
        print(f"dense twin (MLP {k * EXPERT_SIZE} wide): prefill {tokens / seconds[0, 0]:,.0f} tokens/s, "
              f"MLP {mlp_flops(tokens, 0, k, 1) / 1e9:.2f} GFLOP per step of {tokens} tokens "
              f"({tokens // args.seq_tokens} x {args.seq_tokens}); decode {args.decode_rows / seconds[0, 1]:,.0f} tokens/s "
              f"({args.decode_rows} rows)")
        for e in args.experts:
            ratio = mlp_flops(tokens, e, k, CPU_MIN_MATMUL_ROWS) / mlp_flops(tokens, 0, k, 1)
            rows = args.decode_rows
            decode_tile = 1 if steps[e][2] else GENERATED_TILE_ROWS
            decode_ratio = mlp_flops(rows, e, k, decode_tile) / mlp_flops(rows, 0, k, 1)
            print(f"MoE E={e} k={k}: prefill {tokens / seconds[e, 0]:,.0f} tokens/s (a step costs "
                  f"{seconds[e, 0] / seconds[0, 0]:.2f}x the dense twin's), MLP FLOPs at most {ratio:.2f}x the dense "
                  f"twin's (a dense pass of every expert: {e / k:.0f}x); decode {args.decode_rows / seconds[e, 1]:,.0f} "
                  f"tokens/s ({seconds[e, 1] / seconds[0, 1]:.2f}x the dense twin's step; MLP FLOPs at most "
                  f"{decode_ratio:.2f}x, {'native grouped matmul' if steps[e][2] else 'XLA matmuls of 8 rows'})")


if __name__ == "__main__":
    main()
