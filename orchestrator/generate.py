"""`pagefleet generate`: the engine alone in one process, no Ray.

Input lines: {"id", "prompt"} | {"id", "messages"} | {"id", "prompt_token_ids"}. Output: one sample
record per (prompt, generation_index) in input order (DESIGN.md section 4; `batch_id` is null). A
line that cannot run becomes a record with `error` set and no tokens: nothing is dropped.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import draccus

from engine.config import EngineConfig, SamplingConfig


@dataclass(frozen=True)
class GenerateConfig:
    model: str = ""
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)."""
    input: str = ""
    """JSON lines, one prompt each."""
    output: str = ""
    """Where the sample records go (JSON lines, written atomically)."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    progress: bool = True
    """Show a progress bar on stderr."""
    stats_output: str | None = None
    """Also write the engine's performance summary and counters (steps, host and device seconds, tokens/s,
    slot occupancy, preemptions, ...) to this JSON file."""


def _prompt_tokens(row: object, tokenizer) -> tuple[str, list[int] | None, str | None]:
    """(prompt_id, token ids or None, error or None) for one parsed input line."""
    if not isinstance(row, dict):
        return "", None, "line is not a JSON object"
    pid = str(row.get("id", ""))
    if "prompt_token_ids" in row:
        ids = row["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            return pid, None, "prompt_token_ids must be a list of integers"
        return pid, ids, None
    if tokenizer is None:
        return pid, None, "the model directory has no tokenizer; give prompt_token_ids"
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in msgs):
            return pid, None, "messages must be a list of {role, content} objects"
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return pid, tokenizer(text, add_special_tokens=False)["input_ids"], None
    if isinstance(row.get("prompt"), str):
        return pid, tokenizer(row["prompt"])["input_ids"], None
    return pid, None, "line has none of prompt, messages or prompt_token_ids"


def _write_atomically(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_generate(cfg: GenerateConfig) -> int:
    from tqdm import tqdm

    from engine.engine import Completion, Engine
    from engine.sequence import Request

    for name in ("model", "input", "output"):
        if not getattr(cfg, name):
            print(f"pagefleet generate: --{name} is required", file=sys.stderr)
            return 2
    engine = Engine(cfg.model, cfg.engine, dtype=cfg.dtype)
    requests, failed = [], []
    order: list[tuple[str, int]] = []
    first_line: dict[str, int] = {}
    with open(cfg.input, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                row, err = None, f"line {line_no}: malformed JSON ({e.msg})"
            pid, ids, err = _prompt_tokens(row, engine.tokenizer) if row is not None else (f"line-{line_no}", None, err)
            pid = pid or f"line-{line_no}"
            if pid in first_line:  # a repeated id would make two prompts' samples indistinguishable
                ids, err = None, f"duplicate id {pid!r} (first on line {first_line[pid]})"
                pid = f"line-{line_no}"
            first_line.setdefault(pid, line_no)
            for g in range(cfg.sampling.n):
                order.append((pid, g))
                if ids is None:
                    failed.append(Completion(pid, g, "", [], None, None, 0, err))
                else:
                    requests.append(Request(pid, tuple(ids), cfg.sampling, generation_index=g))
    bar = tqdm(total=len(order), desc="samples", unit="sample", disable=not cfg.progress, file=sys.stderr)
    done = engine.generate(requests, on_finish=lambda _: bar.update(1))
    bar.update(len(failed))
    bar.close()
    by_key = {(c.prompt_id, c.generation_index): c for c in done + failed}
    lines = []
    for key in order:
        c = by_key[key]
        record = {"prompt_id": c.prompt_id, "generation_index": c.generation_index, "completion": c.completion,
                  "token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                  "num_prompt_tokens": c.num_prompt_tokens, "batch_id": None}
        if c.error is not None:
            record["error"] = c.error
        lines.append(json.dumps(record) + "\n")
    _write_atomically(Path(cfg.output), lines)
    errors = sum(1 for c in by_key.values() if c.error)
    summary = engine.stats.summary(cfg.engine.max_seqs)
    counters = {k: v for k, v in engine.snapshot().items()
                if k in ("num_preemptions", "num_multi_step_fallbacks", "num_pipelined_calls")}
    print(f"wrote {len(lines)} samples to {cfg.output} ({errors} with errors)", file=sys.stderr)
    if summary["steps"]:
        print(f"{summary['steps']} steps in {summary['wall_s']:.2f} s (device calls {summary['device_s']:.2f} s, "
              f"host {summary['host_s']:.2f} s; step p50 {summary['step_ms_p50']:.1f} ms, "
              f"p90 {summary['step_ms_p90']:.1f} ms, max {summary['step_ms_max']:.1f} ms); "
              f"{summary['decode_tokens_per_s']:.1f} decode tok/s, {summary['prefill_tokens_per_s']:.1f} prefill tok/s; "
              f"slot occupancy mean {summary['mean_slot_occupancy']:.2f}, max {summary['max_slot_occupancy']:.2f}; "
              f"{counters['num_preemptions']} preemptions", file=sys.stderr)
    if cfg.stats_output:
        _write_atomically(Path(cfg.stats_output), [json.dumps({**summary, **counters}, indent=1) + "\n"])
    return 0


def main(argv: list[str]) -> int:
    cfg = draccus.parse(config_class=GenerateConfig, args=argv, prog="pagefleet generate")
    if cfg.engine.attention_impl in ("auto", "cpu_kernel") and cfg.dtype == "float32":
        from engine import kernel_build

        if kernel_build.backend_is_cpu_only():  # the compiler runs while JAX, the tokenizer and weights load
            kernel_build.start()
    return run_generate(cfg)
