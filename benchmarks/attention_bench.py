"""The CPU attention kernel's decoding path alone, against reading the same K/V pages with nothing computed.

    make bench-attention                 # or: JAX_PLATFORMS=cpu python benchmarks/attention_bench.py

A decode step's attention reads every cached K and V of its rows once, so at a context past the caches it can go no
faster than the machine streams those pages. This prints both, alternated in one process, medians:
- the kernel (engine/kernels/cpu_attention.py), `--rows` sequences decoding one token each at contexts drawn from
  `--context` (default: bench-peer's plain workload in its decode phase, 128 rows at 300-575 tokens, llama-40m's
  8 query heads over 4 KV heads of 64, pages of 16 tokens), the pages of all sequences shuffled over the pool as a
  long run leaves them;
- `jax.jit(jnp.sum)` over the same pool (bench-peak's bandwidth probe, at this size): the rate this machine reads
  those bytes with every core. It reads the pool in order, the kernel page by page in a shuffled order: pages of
  32 KiB, each fetched two pages ahead by the kernel, are long enough that the order should cost little, but the
  ratio below counts that cost against the kernel. (A gather in XLA, `pool[pages]`, copies the pages first and is
  no yardstick.)
Between timed calls a 256 MiB array is rewritten, so that each call reads its K/V from memory, not from the L3.

The ratio kernel / pool read is how close decoding is to the memory; what is left is the kernel's arithmetic that
the memory does not hide.

`--prompts 341,341,342` times the kernel's prompt path instead: sequences whose whole prompt is one chunk (a prefill
step's attention in one layer), and prints its median time and GFLOP/s (4 x heads x head_dim per query token and
key it sees, the count benchmarks/flops.py uses). Run it from two revisions to compare them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak_bench import cpu_info  # noqa: E402 - one description of the CPU for every benchmark that names it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="sequences decoding (one token each)")
    parser.add_argument("--context", type=int, nargs=2, default=[300, 575], metavar=("MIN", "MAX"),
                        help="tokens of context of each row, drawn uniformly")
    parser.add_argument("--heads", type=int, nargs=3, default=[8, 4, 64], metavar=("Q", "KV", "HEAD_DIM"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prompts", help="comma-separated prompt lengths: time the prompt path on them instead")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from engine.kernels import cpu_attention

    if (why := cpu_attention.unavailable_reason()) is not None:
        sys.exit(f"attention_bench: the CPU kernel is unavailable here: {why}")
    cpu_attention.load()
    if args.prompts:
        return prompt_path(args, jax, jnp, cpu_attention)
    (heads, kv_heads, head_dim), ps, rows = args.heads, args.page_size, args.rows
    rng = np.random.default_rng(0)
    context = rng.integers(args.context[0], args.context[1] + 1, rows).astype(np.int32)
    pages_of = (context + ps - 1) // ps
    num_pages = int(pages_of.sum())
    page_table = scattered_pages(rng, pages_of)
    pool = jnp.asarray(rng.standard_normal((num_pages, ps, 2 * kv_heads, head_dim), dtype=np.float32))
    q = jnp.asarray(rng.standard_normal((rows, heads, head_dim), dtype=np.float32))
    inputs = (q, pool, jnp.asarray(context), jnp.asarray(page_table), jnp.arange(rows + 1, dtype=jnp.int32),
              jnp.asarray([rows], jnp.int32))
    kernel = jax.jit(lambda *a: cpu_attention.ragged_paged_attention(*a, sm_scale=head_dim**-0.5, sliding_window=None))
    whole = jax.jit(jnp.sum)
    sides = {"kernel": lambda: kernel(*inputs), "pool read": lambda: whole(pool)}
    flush = np.ones(64 * 2**20, np.float32)  # 256 MiB, past any L3
    times: dict[str, list[float]] = {name: [] for name in sides}
    for run in sides.values():
        run().block_until_ready()  # compiled and warm
    for _ in range(args.repeats):
        for name, run in sides.items():
            flush += 1.0
            start = time.perf_counter()
            run().block_until_ready()
            times[name].append(time.perf_counter() - start)
    kv_bytes = int(context.sum()) * 2 * kv_heads * head_dim * 4  # what decoding must read: its tokens' K and V
    page_bytes = num_pages * ps * 2 * kv_heads * head_dim * 4  # whole pages, as the reads move them
    cpu = cpu_info()
    print(f"CPU: {cpu.name}, {cpu.isa}, {cpu.cores} cores ({cpu.cpus} logical CPUs this process may use)")
    print(f"{rows} rows decoding at {args.context[0]}-{args.context[1]} tokens of context; {heads} query heads over "
          f"{kv_heads} KV heads of {head_dim}; pages of {ps}: {kv_bytes / 2**20:,.1f} MiB of K/V "
          f"({page_bytes / 2**20:,.1f} MiB in whole pages); {jax.device_count()} CPU device(s); "
          f"medians of {args.repeats}, sides alternated")
    median = {name: statistics.median(t) for name, t in times.items()}
    for name in sides:
        moved = kv_bytes if name == "kernel" else page_bytes
        print(f"  {name:16s} {median[name] * 1e3:7.2f} ms  {moved / median[name] / 1e9:5.1f} GB/s")
    print(f"kernel / pool read: {(kv_bytes / median['kernel']) / (page_bytes / median['pool read']):.2f} (the kernel's "
          "K/V rate as a fraction of the rate this machine reads the pool)")


def scattered_pages(rng: np.random.Generator, pages_of: np.ndarray) -> np.ndarray:
    """A page table whose sequence s holds pages_of[s] pages, all sequences' pages scattered over one pool."""
    order = rng.permutation(int(pages_of.sum())).astype(np.int32)
    page_table = np.zeros((len(pages_of), int(pages_of.max())), np.int32)
    starts = np.concatenate([[0], np.cumsum(pages_of)])
    for s in range(len(pages_of)):
        page_table[s, :pages_of[s]] = order[starts[s]:starts[s + 1]]
    return page_table


def prompt_path(args, jax, jnp, cpu_attention) -> None:
    """The kernel on whole prompts in one call (each its own sequence, pages shuffled over the pool)."""
    (heads, kv_heads, head_dim), ps = args.heads, args.page_size
    lens = [int(n) for n in args.prompts.split(",")]
    rng = np.random.default_rng(0)
    pages_of = np.array([(n + ps - 1) // ps for n in lens])
    page_table = scattered_pages(rng, pages_of)
    pool = jnp.asarray(rng.standard_normal((int(pages_of.sum()), ps, 2 * kv_heads, head_dim), dtype=np.float32))
    q = jnp.asarray(rng.standard_normal((sum(lens), heads, head_dim), dtype=np.float32))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    inputs = (q, pool, jnp.asarray(lens, jnp.int32), jnp.asarray(page_table), cu, jnp.asarray([len(lens)], jnp.int32))
    kernel = jax.jit(lambda *a: cpu_attention.ragged_paged_attention(*a, sm_scale=head_dim**-0.5, sliding_window=None))
    kernel(*inputs).block_until_ready()  # compiled and warm
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        kernel(*inputs).block_until_ready()
        times.append(time.perf_counter() - start)
    flops = 4 * sum(n * (n + 1) // 2 for n in lens) * heads * head_dim
    cpu = cpu_info()
    print(f"CPU: {cpu.name}, {cpu.isa}, {cpu.cores} cores ({cpu.cpus} logical CPUs this process may use)")
    print(f"prompts of {args.prompts} tokens in one call ({sum(lens):,} query tokens); {heads} query heads over "
          f"{kv_heads} KV heads of {head_dim}; pages of {ps}; median of {args.repeats}")
    median = statistics.median(times)
    print(f"  kernel {median * 1e3:7.2f} ms  {flops / median / 1e9:6.1f} GFLOP/s (fastest {min(times) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
