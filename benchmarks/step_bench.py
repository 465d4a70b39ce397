"""Micro-benchmark of the engine's step function on the ~40M preset (`llama-40m`).

For a few prefill and decode batch shapes it prints tokens/s of `ModelRunner.step` and the fraction
of this machine's matmul peak FLOP/s it reaches. The peak is measured in the same run, interleaved
with the steps (one round = every peak size once, then every shape once), so that noise from other
work on the machine hits both alike; every figure is the median over `--reps` rounds.

Two timings per shape:
- step ms: `runner.logits(chunks)` as the engine calls it: host-side input packing, host->device
  copy, the jitted forward pass and the device->host copy of the logits;
- device ms: the jitted `_forward` alone on inputs already on the device, until the logits are ready.

Run from the repository root:
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/step_bench.py [--dtype bfloat16] [--reps N]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from engine.config import EngineConfig
from engine.models.model_config import ModelConfig
from engine.models.presets import write_model
from engine.device.runner import ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.weights import load_transformer
from flops import chunk_flops

PRESET = "llama-40m"
PAGE_SIZE = 16
MAX_SEQ_LEN = 512
PEAK_SIZES = (1024, 2048)  # square matmuls timed for the machine's peak


@dataclass(frozen=True)
class Shape:
    """One step: `num_seqs` sequences each with `new_tokens` new tokens after `cached_tokens` cached ones."""

    kind: str  # "prefill" | "decode"
    num_seqs: int
    new_tokens: int
    cached_tokens: int

    @property
    def name(self) -> str:
        return f"{self.kind} {self.num_seqs}x{self.new_tokens} @{self.cached_tokens}"

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.new_tokens

    @property
    def pages_per_seq(self) -> int:
        return math.ceil((self.cached_tokens + self.new_tokens) / PAGE_SIZE)


SHAPES = (
    Shape("prefill", 1, 512, 0),  # one whole 512-token prompt
    Shape("prefill", 4, 128, 0),  # four 128-token prompts
    Shape("prefill", 8, 64, 192),  # the last 64-token chunks of eight 256-token prompts
    Shape("decode", 8, 1, 256),
    Shape("decode", 32, 1, 256),
    Shape("decode", 64, 1, 256),
)


def step_flops(cfg: ModelConfig, shape: Shape) -> int:
    """Model FLOPs of one step (benchmarks/flops.py): each sequence's new tokens after its cached ones, its
    logits on one row."""
    return shape.num_seqs * chunk_flops(cfg, shape.new_tokens, shape.cached_tokens, logit_rows=1)


def seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class PeakMatmul:
    """Square `jnp.dot` of one size under jit; FLOP/s = 2 n^3 / time."""

    def __init__(self, n: int, dtype) -> None:
        self.n = n
        ka, kb = jax.random.split(jax.random.key(0))
        self.a = jax.random.normal(ka, (n, n), dtype)
        self.b = jax.random.normal(kb, (n, n), dtype)
        self.dot = jax.jit(jnp.dot)
        self.dot(self.a, self.b).block_until_ready()  # compile
        self.times: list[float] = []

    def time_once(self) -> None:
        self.times.append(seconds(lambda: self.dot(self.a, self.b).block_until_ready()))

    @property
    def flops_per_s(self) -> float:
        return 2 * self.n**3 / statistics.median(self.times)


class ShapeBench:
    """One batch shape on the shared runner: its pages, compile time and the two step timings."""

    def __init__(self, runner: ModelRunner, shape: Shape) -> None:
        self.runner, self.shape = runner, shape
        # The benchmark picks pages itself (no scheduler here): sequence s takes the s-th run of pages_per_seq.
        n = shape.pages_per_seq
        if n * shape.num_seqs > runner.config.max_pages:
            raise RuntimeError(f"{shape.name}: KV pool too small; raise max_pages in make_runner")
        pages = [list(range(s * n, (s + 1) * n)) for s in range(shape.num_seqs)]
        # KV values do not change the cost, so the shapes share pages and the pool only needs to hold the
        # largest shape. The cached context is whatever the pool holds.
        self.chunks = [SeqChunk([3 + s] * shape.new_tokens, shape.cached_tokens, p) for s, p in enumerate(pages)]
        self.inputs = jax.tree.map(jnp.asarray, runner.build_inputs(self.chunks))
        self.padded_tokens, self.padded_seqs = self.inputs.token_ids.shape[0], self.inputs.kv_lens.shape[0]
        self.first_call_s = seconds(lambda: runner.logits(self.chunks))  # compiles unless an earlier shape had the same buckets
        self.host_times: list[float] = []
        self.device_times: list[float] = []
        self._device_step()  # the device-only call has its own input placement; keep it out of the timings

    @property
    def compile_s(self) -> float:
        """First call minus the median step: tracing plus XLA compilation (0 on a cache hit)."""
        return max(0.0, self.first_call_s - statistics.median(self.host_times))

    def _device_step(self) -> None:
        self.runner.logits_on_device(self.inputs, self.chunks).block_until_ready()

    def time_once(self) -> None:
        self.host_times.append(seconds(lambda: self.runner.logits(self.chunks)))
        self.device_times.append(seconds(self._device_step))


def make_runner(dtype) -> ModelRunner:
    with tempfile.TemporaryDirectory() as d:
        model = load_transformer(write_model(PRESET, d, seed=0), dtype=dtype)
        model = jax.block_until_ready(model)
    max_pages = max(s.num_seqs * s.pages_per_seq for s in SHAPES)
    engine = EngineConfig(page_size=PAGE_SIZE, max_pages=max_pages, max_seqs=64, max_prefill_size=512)
    return ModelRunner(model, RunnerConfig.of(engine), MAX_SEQ_LEN, kv_dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter, KV pool and peak-matmul dtype")
    parser.add_argument("--reps", type=int, default=5, help="timed rounds; every figure is their median")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)

    t0 = time.perf_counter()
    peaks = [PeakMatmul(n, dtype) for n in PEAK_SIZES]
    runner = make_runner(dtype)
    cfg = runner.model.config
    benches = [ShapeBench(runner, s) for s in SHAPES]
    for _ in range(args.reps):
        for p in peaks:
            p.time_once()
        for b in benches:
            b.time_once()
    peak = max(p.flops_per_s for p in peaks)

    print(f"{PRESET} ({args.dtype}), backend {jax.default_backend()} with {jax.device_count()} device(s), "
          f"page_size {PAGE_SIZE}, KV pool {runner.config.max_pages} pages = {runner.kv.pool.array.nbytes / 2**20:.0f} MiB, "
          f"medians of {args.reps} reps")
    for p in peaks:
        print(f"  matmul {p.n}x{p.n} {args.dtype}: {p.flops_per_s / 1e9:8.1f} GFLOP/s")
    print(f"  peak = {peak / 1e9:.1f} GFLOP/s")
    header = (f"{'shape':<24}{'tokens':>7}{'padded':>8}{'compile s':>10}{'step ms':>9}{'device ms':>10}"
              f"{'tokens/s':>10}{'GFLOP/s':>9}{'% peak':>8}{'dev % peak':>11}")
    print(header)
    print("-" * len(header))
    for b in benches:
        flops = step_flops(cfg, b.shape)
        step_s, dev_s = statistics.median(b.host_times), statistics.median(b.device_times)
        print(f"{b.shape.name:<24}{b.shape.tokens:>7}{f'{b.padded_tokens}/{b.padded_seqs}':>8}{b.compile_s:>10.2f}"
              f"{step_s * 1e3:>9.1f}{dev_s * 1e3:>10.1f}{b.shape.tokens / step_s:>10.0f}{flops / step_s / 1e9:>9.1f}"
              f"{100 * flops / step_s / peak:>8.1f}{100 * flops / dev_s / peak:>11.1f}")
    print("padded = token bucket / sequence bucket the step is compiled for; compile s = first call - median step; "
          "GFLOP/s and % peak use step ms, dev % peak uses device ms")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
