"""A tiny mixture of experts against its dense twin (the same attention, a dense MLP as wide as the k active experts
together): tokens/s of one engine step and the step's MLP FLOPs, for E experts and top-k.

The MoE's FLOPs are counted, not read from XLA's cost analysis (which counts a loop body once): on the CPU each
expert multiplies its own tokens padded to a multiple of 16 rows, at least 64 (engine/models/moe.py), so a step of T
tokens computes `sum_e max(64, ceil(n_e / 16) * 16)` expert rows over the experts chosen, at most `T * k + E * 63`
(every expert chosen by one token); the router adds `2 * T * H * E`. The dense twin
computes `T` rows of a `k * I`-wide MLP. The figure printed is the bound, so it errs against the MoE.

Every model's step is compiled first; then the models' steps alternate, `--reps` rounds, and the medians are
printed. Run from the repository root (about a minute):
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/moe_bench.py [--experts 8 32] [--top-k 2] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.device.runner import ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.presets import Preset, write_model
from engine.models.weights import load_transformer

HIDDEN, EXPERT_SIZE, LAYERS, PAGE_SIZE, TILE = 256, 256, 4, 16, 64


def preset(experts: int, top_k: int) -> Preset:
    """A Mixtral of `experts` experts (top-k), or with experts=0 its dense twin (a Llama with a k-expert-wide MLP)."""
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6)
    if experts == 0:
        return Preset("llama", intermediate_size=top_k * EXPERT_SIZE, **common)
    return Preset("mixtral", intermediate_size=EXPERT_SIZE, num_experts=experts, experts_per_token=top_k,
                  expert_size=EXPERT_SIZE, **common)


def mlp_flops(tokens: int, experts: int, top_k: int) -> int:
    """Multiply-adds x 2 of one step's MLPs (every layer); for the MoE the bound above."""
    if experts == 0:
        return LAYERS * 2 * tokens * 3 * HIDDEN * top_k * EXPERT_SIZE
    rows = tokens * top_k + experts * (TILE - 1)
    return LAYERS * (2 * rows * 3 * HIDDEN * EXPERT_SIZE + 2 * tokens * HIDDEN * experts)


def step_runner(path: Path, tokens: int):
    """A timed prefill step of `tokens` tokens (4 sequences), compiled and run once: call it for one more step."""
    config = EngineConfig(page_size=PAGE_SIZE, max_pages=4 * tokens // PAGE_SIZE + 8, max_prefill_size=tokens,
                          max_seqs=4)
    runner = ModelRunner(load_transformer(path), RunnerConfig.of(config), max_seq_len=tokens)
    per_seq = tokens // 4
    pages = [list(range(i * per_seq // PAGE_SIZE, (i + 1) * per_seq // PAGE_SIZE)) for i in range(4)]
    chunks = [SeqChunk([7 + (i * 13 + j) % 500 for j in range(per_seq)], 0, pages[i]) for i in range(4)]
    runner.logits(chunks)

    def step() -> float:
        t0 = time.perf_counter()
        runner.logits(chunks)
        return time.perf_counter() - t0
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the timed prefill step")
    parser.add_argument("--reps", type=int, default=15, help="timed steps of each model, alternated")
    args = parser.parse_args()
    k, tokens = args.top_k, args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        # Every model's step is built first, then the steps alternate round by round (the machine's speed drifts).
        steps = {0: step_runner(write_model(preset(0, k), Path(tmp) / "dense"), tokens)}
        steps.update({e: step_runner(write_model(preset(e, k), Path(tmp) / f"moe{e}"), tokens) for e in args.experts})
        times: dict[int, list[float]] = {e: [] for e in steps}
        for _ in range(args.reps):
            for e, step in steps.items():
                times[e].append(step())
        seconds = {e: statistics.median(t) for e, t in times.items()}
        dense = seconds[0]
        print(f"dense twin (MLP {k * EXPERT_SIZE} wide): {tokens / dense:,.0f} tokens/s, "
              f"MLP {mlp_flops(tokens, 0, k) / 1e9:.2f} GFLOP per step of {tokens} tokens")
        for e in args.experts:
            ratio = mlp_flops(tokens, e, k) / mlp_flops(tokens, 0, k)
            print(f"MoE E={e} k={k}: {tokens / seconds[e]:,.0f} tokens/s (a step costs {seconds[e] / dense:.2f}x the "
                  f"dense twin's), MLP FLOPs at most {ratio:.2f}x the dense twin's (a dense pass of every expert: "
                  f"{e / k:.0f}x)")


if __name__ == "__main__":
    main()
