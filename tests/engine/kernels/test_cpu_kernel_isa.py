"""The CPU kernels (attention, and the experts of generated tokens) give the same bits whatever vector instructions
they are built for: with AVX-512, with AVX2 and FMA only (attention: rows 8 to a register, AVX's own score reduction),
and with none (the generic C++ the vector paths must agree with), so a run resumed on, or spread over, machines of
either kind samples the same tokens and logprobs. Each build runs in its own process: all register the same XLA
target name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.kernels import kernel_build
# (head_dim, kv_heads, group, page_size, sliding_window): the compiled head sizes, a partial block of 16 (72), a
# head wider than the registers hold (272), one of no whole number of 8-column blocks (20), pages longer than 16
# keys, and a window. Without a window, decoding sequences share their first pages (rows of several sequences in
# lanes, then each one's own pages from there).
CASES = [(64, 4, 2, 16, 0), (128, 2, 1, 16, 0), (72, 2, 3, 4, 0), (8, 1, 4, 32, 0), (272, 1, 2, 4, 0),
         (20, 2, 2, 16, 0), (64, 4, 2, 16, 20)]
# The experts of generated tokens (moe_experts.cc): (hidden, expert width, experts, rows, top-k); sizes past the
# last whole vector block and the last whole block of 8 weight rows (75, 43), and more than 16 pairs for an expert.
MOE_CASES = [(256, 256, 8, 96, 2), (75, 43, 3, 13, 3)]

WORKER = """
import math, sys
from pathlib import Path
import jax.numpy as jnp
import numpy as np
from engine.kernels import cpu_attention
cpu_attention._load(Path(sys.argv[1]))
out = {}
for head_dim, kv_heads, group, page_size, window in %r:
    rng = np.random.default_rng(head_dim + group + window)
    q_lens = np.array([1, 16, 1, 5, 30, 1, 1, 3, 1, 1])  # decoding tokens (the all-heads path), prompt chunks (lanes)
    ctx = np.array([90, 70, 33, 90, 64, 17, 120, 40, 100, 75])
    pages_per_seq = math.ceil(ctx.max() / page_size)
    num_pages = len(ctx) * pages_per_seq + 1
    pool = rng.standard_normal((num_pages, page_size, 2 * kv_heads, head_dim)).astype(np.float32)
    pages = rng.permutation(num_pages)[:len(ctx) * pages_per_seq].reshape(len(ctx), -1).astype(np.int32)
    if not window:  # decoding sequences on sequence 0's first pages (a prefix cache hit): they walk them together
        for s in (2, 6, 8, 9):
            n = min(ctx[s] - 1, ctx[0] - 1) // page_size
            pages[s, :n] = pages[0, :n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], kv_heads * group, head_dim)).astype(np.float32)
    got = cpu_attention.ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(pool), jnp.asarray(ctx, jnp.int32), jnp.asarray(pages), jnp.asarray(cu),
        jnp.array([len(ctx)], jnp.int32), sm_scale=head_dim**-0.5, sliding_window=window or None)
    out[f"{head_dim}-{kv_heads}-{group}-{page_size}-{window}"] = np.asarray(got)
for hidden, width, experts, rows, k in %r:
    rng = np.random.default_rng(hidden + width + experts)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = [rng.standard_normal(s).astype(np.float32) * 0.1
         for s in ((experts, hidden, width), (experts, hidden, width), (experts, width, hidden))]
    pair_expert = rng.integers(0, experts + 1, rows * k).astype(np.int32)  # `experts`: none
    got = cpu_attention.moe_experts(jnp.asarray(x), jnp.asarray(pair_expert), *map(jnp.asarray, w))
    out[f"moe-{hidden}-{width}-{experts}-{rows}-{k}"] = np.asarray(got)
np.savez(sys.argv[2], **out)
""" % (CASES, MOE_CASES)


def _cpu_flags() -> set[str]:
    try:
        return set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def _has_avx512() -> bool:
    return {"avx512f", "avx2"} <= _cpu_flags()


def _outputs(library: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    out = tmp_path / f"{library.stem}.npz"
    subprocess.run([sys.executable, "-c", WORKER, str(library), str(out)], check=True,
                   cwd=Path(__file__).resolve().parents[3])
    with np.load(out) as arrays:
        return dict(arrays)


@pytest.mark.skipif(not _has_avx512(), reason="needs an x86 CPU with AVX-512 to build and run both variants")
def test_cpu_kernel_without_avx512_gives_the_same_bits(tmp_path):
    native = kernel_build.build()
    cmd, _ = kernel_build._plan()
    avx2 = tmp_path / "avx2.so"
    subprocess.run([*cmd, "-mno-avx512f", "-o", str(avx2)], check=True, capture_output=True)
    assert avx2.read_bytes() != native.read_bytes(), "the two builds are the same code: the test shows nothing"
    wide, narrow = _outputs(native, tmp_path), _outputs(avx2, tmp_path)
    assert wide.keys() == narrow.keys() and len(wide) == len(CASES) + len(MOE_CASES)
    for case, a in wide.items():
        assert np.isfinite(a).all(), case
        np.testing.assert_array_equal(narrow[case], a, err_msg=case)


@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="needs an x86 CPU with AVX2 and FMA")
def test_cpu_kernel_vector_paths_give_the_bits_of_its_generic_code(tmp_path):
    """The native build (AVX2's or AVX-512's vector paths, whichever this CPU has) against a build with no AVX
    at all: there every multiply-add is std::fma and every score tree is summed lane by lane in plain C++."""
    native = kernel_build.build()
    cmd, _ = kernel_build._plan()
    generic = tmp_path / "generic.so"
    subprocess.run([*cmd, "-mno-avx", "-o", str(generic)], check=True, capture_output=True)
    vector, plain = _outputs(native, tmp_path), _outputs(generic, tmp_path)
    assert vector.keys() == plain.keys() and len(vector) == len(CASES) + len(MOE_CASES)
    for case, a in vector.items():
        assert np.isfinite(a).all(), case
        np.testing.assert_array_equal(plain[case], a, err_msg=case)
