"""The yardstick: this machine's float32 matmul peak and memory bandwidth, and the engine's prefill and decode
rates on the plain workload as fractions of them.

    make bench-peak                       # or: PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/peak_bench.py

Printed, in order:

1. the CPU: its model name, the cores this process may run on (physical cores, from sysfs topology), the
   instruction set its flags show (AVX-512F, AVX2, FMA; on another architecture, which one) and its clock
   (cpufreq's maximum, else lscpu's "CPU max MHz", else /proc/cpuinfo's current "cpu MHz"; the source is named);
2. the FMA ceiling from those flags and that clock: cores x GHz x 2 FMA units per core x float32 lanes (16 with
   AVX-512F, 8 with AVX2, 8 on AMD Zen 4, whose 256-bit units run an AVX-512 instruction in two halves, and 4 on
   Zen and Zen+, whose 128-bit units do the same with an AVX2 one; the
   CPU line names AMD's core generation from /proc/cpuinfo's family and model) x 2 FLOP. Two FMA units per core
   is an assumption (true of recent Intel and AMD server cores; some parts have one 512-bit unit), not read from
   the machine: a ceiling, never a measurement;
3. the measured matmul peak: the median GFLOP/s of square float32 GEMMs (1024 and 2048) through numpy's BLAS and
   through `jax.jit(jnp.dot)` (XLA's CPU dot), the best of each library and the best of both. That best is the
   peak every "% peak" below divides by;
4. memory bandwidth, measured the same way: the median GB/s over 512 MiB float32 arrays of a numpy sum and a
   `jax.jit(jnp.sum)` (bytes read) and a numpy copy (bytes read + bytes written; write-allocate traffic not
   counted), the best of the three. Both 3 and 4 run before the engine and again after it, and the higher of
   the two readings is kept, so that a slow first reading cannot flatter a fraction;
5. the engine on the plain workload: `--num-prompts` prompts of 16-512 tokens as benchmarks/generate_bench.py
   draws them (with 256, bench-peer's `plain`; `--workload shared-prefix`: bench-peer's other workload), on
   bench-peer's llama-40m without EOS (every sample runs to `--new-tokens`), greedy, float32, `pagefleet
   generate` sized for the machine (no engine flags unless `--pagefleet-flags`). One untimed run fills the XLA
   compile cache, then `--repeats` measured runs; each total (steps, tokens, seconds, FLOPs, bytes) is the median
   over them, and the rates are taken from those.

`pagefleet generate --stats_output` holds the engine's summary, not its steps, so the engine runs as
`peak_bench.py --engine-worker STEPS -- generate ...`: pagefleet's own command line in a process of its own, with
one hook on `Engine._run` that records each device call (its per-step stats, when it ended, and every
sequence's new tokens and the position they start at). From those steps:

- prefill: the steps that feed any prompt token. A step that also decodes running sequences (a mixed step)
  counts here whole: its time and all its FLOPs, its decode tokens included (printed apart); the time of one
  device call cannot be split between its rows;
- decode: the steps that feed no prompt token (ragged steps of one-token chunks and multi-step decode calls):
  tokens/s, model FLOP/s (benchmarks/flops.py) and the KV read rate: every decoded token reads the K and V of
  its whole context (its position + 1 tokens) in every layer, ctx x layers x 2 x kv heads x head dim x bytes,
  counted on real tokens (the kernel reads whole pages: the page-rounded figure is printed too). The weights a
  forward pass reads are printed beside it (matmul weights and LM head, once per pass);
- time: "loop" is a step's share of the engine loop, from the previous step's end to its own (scheduling and
  post-processing included: what the workload costs); "step" is the device call as the engine's stats time it
  (with pipelined decoding a call's compute partly overlaps the host work before it, so step-time rates run high).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine.models.model_config import ModelConfig  # noqa: E402
from flops import chunk_flops, matmul_params  # noqa: E402 - one FLOP formula for every benchmark
from generate_bench import matmul_peak, run_timed, write_inputs  # noqa: E402 - the plain workload's draw, the jnp.dot peak
from peer_bench import write_model, write_workloads  # noqa: E402 - llama-40m without EOS; bench-peer's workloads

GEMM_SIZES = (1024, 2048)
BANDWIDTH_MIB = 512
REPS = 5  # per GEMM size and bandwidth probe; each figure is their median


# -- the CPU ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cpu:
    model: str
    arch: str
    cores: int  # physical cores among the CPUs this process may run on
    cpus: int  # logical CPUs this process may run on
    flags: frozenset[str]
    mhz: float
    clock_source: str
    vendor: str = ""
    family: int = 0  # /proc/cpuinfo "cpu family" and "model" (x86): which core design, where the flags cannot say
    model_number: int = 0

    @property
    def x86(self) -> bool:
        return self.arch in ("x86_64", "AMD64", "i686")

    @property
    def isa(self) -> str:
        if not self.x86:
            return f"not x86 ({self.arch}): no AVX; flags {' '.join(sorted(self.flags)) or 'unknown'}"
        vector = "AVX-512F" if "avx512f" in self.flags else "AVX2" if "avx2" in self.flags else (
            "AVX" if "avx" in self.flags else "SSE only")
        extra = sorted(f for f in self.flags if f.startswith(("avx512", "amx")) and f != "avx512f")
        return f"{vector}{' + FMA' if 'fma' in self.flags else ', no FMA'}" + (f" (also {' '.join(extra)})" if extra else "")

    @property
    def core_design(self) -> str:
        """AMD's core generation from family and model (AMD documents the ranges), else ""."""
        if self.vendor != "AuthenticAMD":
            return ""
        if self.family == 0x1A:
            return "Zen 5"
        if self.family == 0x19:
            return "Zen 4" if self.model_number in range(0x10, 0x20) or self.model_number in range(0x60, 0x80) \
                or self.model_number in range(0xA0, 0xB0) else "Zen 3"
        if self.family == 0x17:  # Zen and Zen+ below model 0x30 (Naples, Summit/Pinnacle/Raven Ridge), Zen 2 from it
            return "Zen 2" if self.model_number >= 0x30 else "Zen or Zen+"
        return ""

    @property
    def name(self) -> str:
        """The model name, with AMD's core generation (and the family and model it is read from) where known."""
        design = f", {self.core_design} (family {self.family:#x}, model {self.model_number:#x})" if self.core_design else ""
        return f"{self.model}{design}"

    @property
    def lanes(self) -> int:
        """float32 lanes of the widest vector unit the flags show, as the FMA units execute them: Zen 4 runs an
        AVX-512 instruction as two halves on 256-bit units, so 8 there; Zen and Zen+ run an AVX2 one as two halves
        on 128-bit units, so 4."""
        if "avx512f" in self.flags and self.core_design != "Zen 4":
            return 16
        return 8 if "avx" in self.flags and self.core_design != "Zen or Zen+" else 4

    def fma_ceiling(self) -> float | None:
        """cores x Hz x 2 FMA units (assumed) x lanes x 2 FLOP; None without x86 FMA."""
        if not self.x86 or "fma" not in self.flags:
            return None
        return self.cores * self.mhz * 1e6 * 2 * self.lanes * 2


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}


def cpu_info() -> Cpu:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    first = lambda key: next((m.group(1).strip() for m in re.finditer(rf"^{key}\s*:(.*)$", cpuinfo, re.M)), "")  # noqa: E731
    lscpu = _lscpu()
    cpus = sorted(os.sched_getaffinity(0))
    topo = Path("/sys/devices/system/cpu")
    try:
        cores = len({((topo / f"cpu{c}/topology/physical_package_id").read_text(), (topo / f"cpu{c}/topology/core_id").read_text())
                     for c in cpus})
    except OSError:
        cores = len(cpus)
    max_freq = topo / "cpu0/cpufreq/cpuinfo_max_freq"
    if max_freq.exists():
        mhz, source = int(max_freq.read_text()) / 1e3, "cpufreq cpuinfo_max_freq"
    elif lscpu.get("CPU max MHz"):
        mhz, source = float(lscpu["CPU max MHz"]), "lscpu CPU max MHz"
    else:
        mhz, source = float(first("cpu MHz") or 0), "/proc/cpuinfo cpu MHz (current: no maximum reported)"
    return Cpu(model=first("model name") or lscpu.get("Model name", "unknown"), arch=platform.machine(), cores=cores,
               cpus=len(cpus), flags=frozenset((first("flags") or first("Features")).split()), mhz=mhz,
               clock_source=source, vendor=first("vendor_id"), family=int(first("cpu family") or 0),
               model_number=int(first("model") or 0))


# -- the machine's peak and bandwidth -----------------------------------------------------------

def median_seconds(fn: Callable[[], object], reps: int = REPS) -> float:
    fn()  # warm-up: first-touch pages, compilation, thread pools
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def numpy_blas() -> str:
    import numpy as np

    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas['name']} {blas.get('version', '')}".strip()
    except (TypeError, KeyError):
        return "numpy's BLAS"


def numpy_gemm_peak() -> tuple[float, int]:
    """Best over GEMM_SIZES of the median float32 `a @ b` FLOP/s, and its size."""
    import numpy as np

    rng = np.random.default_rng(0)
    best = (0.0, 0)
    for n in GEMM_SIZES:
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        best = max(best, (2 * n**3 / median_seconds(lambda: a @ b), n))
    return best


@dataclass(frozen=True)
class Machine:
    """One reading of the matmul peak (FLOP/s) and memory bandwidth (bytes/s), by library."""

    numpy_gemm: tuple[float, int]
    jax_gemm: tuple[float, int]
    numpy_sum: float
    jax_sum: float
    numpy_copy: float

    @property
    def peak(self) -> float:
        return max(self.numpy_gemm[0], self.jax_gemm[0])

    @property
    def bandwidth(self) -> float:
        return max(self.numpy_sum, self.jax_sum, self.numpy_copy)


def measure_machine() -> Machine:
    import jax
    import jax.numpy as jnp
    import numpy as np

    numpy_gemm = numpy_gemm_peak()
    jax_gemm = matmul_peak(GEMM_SIZES, REPS)
    a = np.ones(BANDWIDTH_MIB * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    numpy_sum = a.nbytes / median_seconds(a.sum)
    numpy_copy = 2 * a.nbytes / median_seconds(lambda: np.copyto(b, a))  # read a, write b
    del b
    x, total = jnp.asarray(a), jax.jit(jnp.sum)
    del a
    jax_sum = x.nbytes / median_seconds(lambda: total(x).block_until_ready())
    return Machine(numpy_gemm, jax_gemm, numpy_sum, jax_sum, numpy_copy)


# -- the engine: pagefleet generate with its steps recorded (the worker) ------------------------

def engine_worker(steps_path: str, argv: list[str]) -> int:
    """Run `pagefleet <argv>` in this process, recording each device call into `steps_path` (JSON).

    A step's chunks are [new tokens, position of the first, logit rows, decode] per sequence: a ragged step's
    chunks as scheduled (a one-token chunk that completes its sequence is a decode), a multi-step decode call's
    live rows with the forward passes each took (a resumed call's rows go on from where the call before ended)."""
    from engine.engine import Engine
    from orchestrator.commands.cli import hide_torch, main

    steps: list[dict] = []
    next_position: dict[int, int] = {}  # per sequence: the position its next fed token takes
    seen: dict[str, object] = {}
    run = Engine._run

    def recorded(engine, out, counts):
        start = time.perf_counter()
        result = run(engine, out, counts)
        end = time.perf_counter()
        seen["engine"] = engine
        chunks = []
        if out.decode is None:
            for i, c in enumerate(out.chunks):
                decode = c.num_tokens == 1 and c.completes
                chunks.append([c.num_tokens, c.start, out.row_chunk.count(i), decode])
                next_position[c.seq_id] = c.start + c.num_tokens
        else:
            call = out.decode
            for r, (seq, live) in enumerate(zip(call.seq_ids, call.live)):
                first = next_position[seq] if call.resume else call.starts[r]
                passes = int(result.steps[r])
                if live and passes:
                    chunks.append([passes, first, passes, True])
                next_position[seq] = first + passes
        s = engine.stats
        steps.append(dict(start=start, end=end, step_s=s.step_s[-1], device_s=s.device_s[-1],
                          prefill_tokens=s.prefill_tokens[-1], decode_tokens=s.decode_tokens[-1],
                          model_steps=s.model_steps[-1], chunks=chunks))
        return result

    Engine._run = recorded
    hide_torch()
    code = main(argv)
    engine = seen["engine"]
    Path(steps_path).write_text(json.dumps({
        "kv_itemsize": engine.runner.kv.pool.array.dtype.itemsize, "page_size": engine.config.page_size,
        "max_seqs": engine.config.max_seqs, "steps": steps}))
    return code


def engine_run(model: Path, prompts: Path, work: Path, new_tokens: int, flags: list[str], env: dict[str, str]) -> dict:
    steps, stats = work / "steps.json", work / "stats.json"
    cmd = [sys.executable, __file__, "--engine-worker", str(steps), "--", "generate", f"--model={model}",
           f"--input={prompts}", f"--output={work / 'out.jsonl'}", f"--sampling.max_new_tokens={new_tokens}",
           "--sampling.temperature=0", "--progress=false", f"--stats_output={stats}", *flags]
    wall, _ = run_timed(cmd, env)
    return dict(wall_s=wall, summary=json.loads(stats.read_text()), **json.loads(steps.read_text()))


# -- figures ------------------------------------------------------------------------------------

def figures(run: dict, cfg: ModelConfig) -> dict[str, float]:
    """One run's prefill and decode figures (see the module docstring)."""
    steps = run["steps"]
    kv_token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * run["kv_itemsize"]
    weight_bytes = (matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size) * 4  # float32 weights, read once per pass
    page = run["page_size"]
    f = dict.fromkeys(("prefill_steps", "prefill_loop_s", "prefill_step_s", "prefill_tokens", "prefill_flops",
                       "mixed_steps", "mixed_decode_tokens", "mixed_decode_flops", "decode_steps", "decode_loop_s",
                       "decode_step_s", "decode_tokens", "decode_flops", "kv_bytes", "kv_page_bytes", "weight_bytes",
                       "all_flops"), 0.0)
    previous_end = steps[0]["start"]
    for s in steps:
        loop_s, previous_end = s["end"] - previous_end, s["end"]
        flops = [chunk_flops(cfg, n, first, rows) for n, first, rows, _ in s["chunks"]]
        f["all_flops"] += sum(flops)
        kind = "prefill" if s["prefill_tokens"] else "decode"
        f[f"{kind}_steps"] += 1
        f[f"{kind}_loop_s"] += loop_s
        f[f"{kind}_step_s"] += s["step_s"]
        f[f"{kind}_flops"] += sum(flops)
        if kind == "prefill":
            f["prefill_tokens"] += s["prefill_tokens"]
            decodes = [(c, fl) for c, fl in zip(s["chunks"], flops) if c[3]]
            f["mixed_steps"] += bool(decodes)
            f["mixed_decode_tokens"] += sum(c[0] for c, _ in decodes)
            f["mixed_decode_flops"] += sum(fl for _, fl in decodes)
            continue
        f["decode_tokens"] += s["decode_tokens"]
        f["weight_bytes"] += s["model_steps"] * weight_bytes
        for n, first, _, _ in s["chunks"]:  # the token at position p reads p + 1 tokens of context
            ctx = range(first + 1, first + n + 1)
            f["kv_bytes"] += sum(ctx) * kv_token_bytes
            f["kv_page_bytes"] += sum(-(-c // page) * page for c in ctx) * kv_token_bytes
    f["loop_s"] = steps[-1]["end"] - steps[0]["start"]
    f["first_step_s"] = steps[0]["step_s"]
    return f


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def print_machine(before: Machine, after: Machine, blas: str) -> Machine:
    """Print both readings; return the higher one of each figure (the denominators)."""
    best = max(before, after, key=lambda m: m.peak)
    bw = max(before, after, key=lambda m: m.bandwidth)
    for name, m in (("before the engine", before), ("after it", after)):
        print(f"  {name}: GEMM numpy ({blas}) {m.numpy_gemm[0] / 1e9:.1f} GFLOP/s at {m.numpy_gemm[1]}, "
              f"jax.jit(jnp.dot) {m.jax_gemm[0] / 1e9:.1f} GFLOP/s at {m.jax_gemm[1]}; "
              f"memory: numpy sum {m.numpy_sum / 1e9:.1f} GB/s read, jnp.sum {m.jax_sum / 1e9:.1f} GB/s read, "
              f"numpy copy {m.numpy_copy / 1e9:.1f} GB/s read + written")
    library = "numpy" if best.numpy_gemm[0] >= best.jax_gemm[0] else "jax.jit(jnp.dot)"
    probe = max((("numpy sum", bw.numpy_sum), ("jnp.sum", bw.jax_sum), ("numpy copy", bw.numpy_copy)), key=lambda p: p[1])
    print(f"measured matmul peak: {best.peak / 1e9:.1f} GFLOP/s ({library}, the higher reading): the denominator of % peak")
    print(f"measured memory bandwidth: {bw.bandwidth / 1e9:.1f} GB/s ({probe[0]}, the higher reading): the denominator "
          f"of % bandwidth")
    return Machine(best.numpy_gemm, best.jax_gemm, bw.numpy_sum, bw.jax_sum, bw.numpy_copy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=256, help="plain workload only")
    ap.add_argument("--workload", choices=("plain", "shared-prefix"), default="plain",
                    help="bench-peer's workload to run the engine on (shared-prefix: its 256 prompts, "
                         "--num-prompts ignored)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="measured engine runs; every engine figure is their median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pagefleet-flags", default="", help="extra `pagefleet generate` flags, e.g. '--engine.max_seqs=32'")
    ap.add_argument("--workdir", default="/tmp/pagefleet-peakbench")
    ap.add_argument("--engine-worker", metavar="STEPS", help=argparse.SUPPRESS)
    ap.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_worker:
        raise SystemExit(engine_worker(args.engine_worker, args.argv))

    cpu = cpu_info()
    print(f"CPU: {cpu.name} ({cpu.arch}), {cpu.cores} cores ({cpu.cpus} logical CPUs this process may use), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"instruction set: {cpu.isa}")
    print(f"clock: {cpu.mhz:.0f} MHz ({cpu.clock_source})")
    ceiling = cpu.fma_ceiling()
    if ceiling is None:
        print("FMA ceiling: none computed (needs x86 with the fma flag)")
    else:
        halves = {"Zen 4": " (AVX-512 on 256-bit units)",
                  "Zen or Zen+": " (AVX2 on 128-bit units)"}.get(cpu.core_design, "")
        print(f"FMA ceiling from flags and clock (not measured): {cpu.cores} cores x {cpu.mhz / 1e3:.2f} GHz x 2 FMA units "
              f"per core (assumed) x {cpu.lanes} float32 lanes{halves} x 2 FLOP = {ceiling / 1e9:.1f} GFLOP/s")

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work)
    if args.workload == "plain":
        _, prompts_path, prompts = write_inputs(work, args.num_prompts, 16, 512, args.seed)
    else:
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prompts_path, prompts = write_workloads(work, vocab, args.seed)[args.workload]
    cfg = ModelConfig.from_pretrained(str(model))
    before = measure_machine()

    flags = args.pagefleet_flags.split()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PAGEFLEET_COMPILE_CACHE": str(work / "xla")}
    engine_run(model, prompts_path, work, args.new_tokens, flags, env)  # fills the compile cache, untimed
    runs = [engine_run(model, prompts_path, work, args.new_tokens, flags, env) for _ in range(args.repeats)]
    after = measure_machine()
    machine = print_machine(before, after, numpy_blas())
    if ceiling is not None:
        above = (f" (above it: the cores ran faster than the {cpu.mhz:.0f} MHz read from {cpu.clock_source.split(' (')[0]})"
                 if machine.peak > ceiling else "")
        print(f"  the measured peak is {machine.peak / ceiling:.0%} of the FMA ceiling{above}")

    lens = [len(p) for p in prompts]
    last = runs[-1]
    print(f"\nengine: llama-40m without EOS, float32, the {args.workload} workload: {len(prompts)} prompts of "
          f"{min(lens)}..{max(lens)} tokens "
          f"({sum(lens):,} prompt tokens, seed {args.seed}), {args.new_tokens} new tokens each, greedy; `pagefleet "
          f"generate` {args.pagefleet_flags or '(sized for the machine)'}: max_seqs {last['max_seqs']}, page_size "
          f"{last['page_size']}; median of {args.repeats} measured run(s) after one that filled the compile cache "
          f"(whole process {statistics.median(r['wall_s'] for r in runs):.1f} s)")
    f = median_figures([figures(r, cfg) for r in runs])
    peak, bw = machine.peak, machine.bandwidth
    pct = lambda flops, s: 100 * flops / s / peak if s else 0.0  # noqa: E731
    header = (f"{'':9}{'steps':>6}{'tokens':>9}{'loop s':>8}{'step s':>8}{'tok/s':>9}{'GFLOP/s':>9}{'% peak':>8}"
              f"{'step-time % peak':>18}")
    print(header)
    print("-" * len(header))
    for kind in ("prefill", "decode"):
        loop_s, step_s, flops = f[f"{kind}_loop_s"], f[f"{kind}_step_s"], f[f"{kind}_flops"]
        print(f"{kind:9}{f[f'{kind}_steps']:>6.0f}{f[f'{kind}_tokens']:>9.0f}{loop_s:>8.2f}{step_s:>8.2f}"
              f"{f[f'{kind}_tokens'] / max(loop_s, 1e-9):>9.0f}{flops / max(loop_s, 1e-9) / 1e9:>9.1f}"
              f"{pct(flops, loop_s):>8.1f}{pct(flops, step_s):>18.1f}")
    print(f"all steps: {f['all_flops'] / 1e12:.3f} TFLOP in a {f['loop_s']:.2f} s loop = "
          f"{f['all_flops'] / f['loop_s'] / 1e9:.1f} GFLOP/s, {pct(f['all_flops'], f['loop_s']):.1f}% of peak")
    print(f"prefill counts every step that feeds a prompt token, whole: {f['mixed_steps']:.0f} of its "
          f"{f['prefill_steps']:.0f} steps also decoded ({f['mixed_decode_tokens']:.0f} decode tokens, "
          f"{100 * f['mixed_decode_flops'] / max(f['prefill_flops'], 1):.1f}% of prefill FLOPs), which are not in the "
          f"decode row; prefill tokens are prompt tokens fed; the process's first step (a prefill step), which also "
          f"loads its programs from the compile cache, took {f['first_step_s']:.2f} s")
    loop_s = max(f["decode_loop_s"], 1e-9)
    print(f"decode KV read: {f['kv_bytes'] / 1e9:.2f} GB (real context tokens) in {f['decode_loop_s']:.2f} s = "
          f"{f['kv_bytes'] / loop_s / 1e9:.1f} GB/s, {100 * f['kv_bytes'] / loop_s / bw:.1f}% of the measured bandwidth "
          f"(whole pages: {f['kv_page_bytes'] / loop_s / 1e9:.1f} GB/s, {100 * f['kv_page_bytes'] / loop_s / bw:.1f}%); "
          f"with the weights each forward pass reads ({f['weight_bytes'] / 1e9:.2f} GB): "
          f"{(f['kv_bytes'] + f['weight_bytes']) / loop_s / 1e9:.1f} GB/s, "
          f"{100 * (f['kv_bytes'] + f['weight_bytes']) / loop_s / bw:.1f}%")


if __name__ == "__main__":
    main()
