"""Greedy samples under vLLM's sampling settings, pagefleet against vLLM's CPU build: the same tokens, the same
finish_reason and logprobs within 1e-4 for every prompt and setting below.

    make check-peer-sampling             # or: python benchmarks/sampling_peer.py

The model is the `llama-40m` preset without its tokenizer (vLLM's side then knows only generation_config.json's EOS
ids, as pagefleet's does), its generation_config.json naming as EOS the token its greedy samples of these prompts
draw most often early on, so that samples end there; each prompt's own `stop_token_ids` is the token its free
sample draws ninth. The settings are each row's own (a `sampling` object, as `pagefleet generate` lines carry it;
vLLM's `SamplingParams` of the same names): stop ids, `min_tokens` holding EOS and stop ids back, `ignore_eos`, the
three penalties, `min_p`. vLLM's side is `LLM.generate` with `logprobs=0` (its raw logprobs); pagefleet's is
`pagefleet.generate`. vLLM is installed as for benchmarks/peer_bench.py (`.peer/vllm-venv`); the model lives under
`.peer/work/sampling-<pid>` while the check runs. Prints each sample that differs and exits 1 when any does.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import PEER, ROOT, VENV, ensure_vllm_venv, vllm_env  # noqa: E402 - one vLLM install for both

NEW_TOKENS = 48
PROMPTS = 32
SETTINGS = {
    "stop_ids": lambda stop: {"stop_token_ids": stop},
    "min_tokens": lambda stop: {"stop_token_ids": stop, "min_tokens": 24},
    "ignore_eos": lambda stop: {"ignore_eos": True},
    "ignore_eos_min_tokens": lambda stop: {"ignore_eos": True, "min_tokens": 10, "stop_token_ids": stop},
    "penalties": lambda stop: {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    "min_p_min_tokens": lambda stop: {"min_p": 0.2, "min_tokens": 40},
}
"""Each case's row settings from the row's stop id list."""


def vllm_worker(model: str, rows_path: str, output: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0)
    rows = [json.loads(line) for line in open(rows_path)]
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, **r["sampling"]) for r in rows]
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows], params, use_tqdm=False)
    result = {}
    for r, o in zip(rows, outs):
        c = o.outputs[0]
        result[r["id"]] = {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                           "logprobs": [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]}
    Path(output).write_text(json.dumps(result))


def prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(5)
    return [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(16, 129, PROMPTS)]


def write_model(work: Path) -> tuple[Path, list[dict]]:
    """The model (EOS as the module doc says) and the rows of every case."""
    import pagefleet

    full, model = work / "llama-40m", work / "model"
    subprocess.run([sys.executable, "-m", "orchestrator", "init-model", "--preset", "llama-40m", "--output",
                    str(full)], cwd=ROOT, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    model.mkdir()
    config = json.loads((full / "config.json").read_text())
    config["eos_token_id"] = None
    (model / "config.json").write_text(json.dumps(config))
    shutil.copy(full / "model.safetensors", model / "model.safetensors")
    ps = prompts(config["vocab_size"])
    free = [r["token_ids"] for r in pagefleet.generate(str(model), [{"prompt_token_ids": p} for p in ps],
                                                       max_new_tokens=NEW_TOKENS)]
    early = collections.Counter(t for tokens in free for t in set(tokens[3:24]))
    eos = early.most_common(1)[0][0]
    config["eos_token_id"] = eos
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    rows = [{"id": f"{case}/{i}", "prompt_token_ids": p, "sampling": settings([tokens[8]])}
            for case, settings in SETTINGS.items() for i, (p, tokens) in enumerate(zip(ps, free))]
    return model, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-worker", nargs=3, metavar=("MODEL", "ROWS", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    import pagefleet

    ensure_vllm_venv()
    work, scratch = PEER / "work" / f"sampling-{os.getpid()}", PEER / "scratch"
    work.mkdir(parents=True)
    model, rows = write_model(work)
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run([str(VENV / "bin" / "python"), __file__, "--vllm-worker", str(model), str(work / "rows.jsonl"),
                    str(work / "vllm.json")], check=True, env=vllm_env(scratch), cwd=work)
    theirs = json.loads((work / "vllm.json").read_text())
    ours = {r["prompt_id"]: r for r in pagefleet.generate(str(model), rows, max_new_tokens=NEW_TOKENS, logprobs=True)}
    shutil.rmtree(work)  # a 160 MB model an invocation; the differences are printed
    differ, worst = [], 0.0
    for name, v in theirs.items():
        o = ours[name]
        if o["token_ids"] != v["token_ids"] or o["finish_reason"] != v["finish_reason"]:
            differ.append(f"DIFFERS {name}\n  pagefleet: {o['token_ids']} {o['finish_reason']}\n"
                          f"  vLLM:      {v['token_ids']} {v['finish_reason']}")
            continue
        gap = max((abs(a - b) for a, b in zip(o["logprobs"], v["logprobs"])), default=0.0)
        worst = max(worst, gap)
        if gap > 1e-4:
            differ.append(f"DIFFERS {name}: logprobs differ by {gap:.2e}")
    print("\n".join(differ))
    lengths = collections.defaultdict(list)
    for name, o in ours.items():
        lengths[name.split("/")[0]].append(len(o["token_ids"]))
    print("samples of each case (lengths min-max): " + ", ".join(f"{c} {min(n)}-{max(n)}" for c, n in lengths.items()))
    print(f"{len(theirs) - len(differ)} of {len(theirs)} samples: the same tokens and finish_reason, logprobs within "
          f"{worst:.1e}; {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
