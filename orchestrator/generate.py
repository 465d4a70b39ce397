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

from engine import EngineConfig, SampleRecord, SamplingConfig
from orchestrator.corpus import CorpusConfig, RawRow, Rejection, extract_prompt, row_id


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


# The generate input's fields, judged by the same rules as a run's corpus rows (orchestrator.corpus).
_FIELDS = CorpusConfig(path="", id_field="id", text_field="prompt", messages_field="messages")


def _parse_line(raw: bytes, line_no: int, tokenizer) -> tuple[str | None, list[int] | None, str | None]:
    """(prompt_id or None when the line has none, token ids or None, error or None) for one input line.

    Lines are judged as `pagefleet run` judges corpus rows, and an error names the same reasons as its
    rejected.jsonl: a line that is not UTF-8, not JSON or not an object, an empty prompt or message list, a
    field of the wrong type or no prompt field at all is an error record, never repaired or dropped."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, None, f"undecodable: line {line_no} is not UTF-8 ({e.reason} at byte {e.start})"
    except ValueError as e:
        return None, None, f"malformed_row: line {line_no} is not valid JSON ({e})"
    if not isinstance(row, dict):
        return None, None, f"malformed_row: line {line_no} is a JSON {type(row).__name__}, not an object"
    pid = row_id(row, "id", None)
    if isinstance(pid, Rejection):
        return None, None, f"{pid.reason}: {pid.detail}"
    if "prompt_token_ids" in row:  # bypasses the tokenizer ("prompt" or "messages" beside it are not read)
        ids = row["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return pid, None, "wrong_type: prompt_token_ids must be a list of integers"
        return pid, ids, None
    parsed = extract_prompt(RawRow(line_no - 1, "", line_no, row), _FIELDS)
    if isinstance(parsed, Rejection):
        return pid, None, f"{parsed.reason}: {parsed.detail}"
    if tokenizer is None:
        return pid, None, "the model directory has no tokenizer; give prompt_token_ids"
    if parsed.messages is not None:
        text = tokenizer.apply_chat_template(parsed.messages, tokenize=False, add_generation_prompt=True)
        return pid, tokenizer(text, add_special_tokens=False)["input_ids"], None
    return pid, tokenizer(parsed.text)["input_ids"], None


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

    from engine import Engine, Request

    for name in ("model", "input", "output"):
        if not getattr(cfg, name):
            print(f"pagefleet generate: --{name} is required", file=sys.stderr)
            return 2
    engine = Engine(cfg.model, cfg.engine, dtype=cfg.dtype)
    requests, failed = [], []
    order: list[tuple[str, int]] = []
    first_line: dict[str, int] = {}
    with open(cfg.input, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            pid, ids, err = _parse_line(line, line_no, engine.tokenizer)
            pid = pid or f"line-{line_no}"
            if pid in first_line:  # a repeated id would make two prompts' samples indistinguishable
                ids, err = None, f"duplicate id {pid!r} (first on line {first_line[pid]})"
                pid = f"line-{line_no}"
            first_line.setdefault(pid, line_no)
            for g in range(cfg.sampling.n):
                order.append((pid, g))
                if ids is None:
                    failed.append(SampleRecord(pid, g, "", [], None, None, 0, error=err))
                else:
                    requests.append(Request(pid, tuple(ids), cfg.sampling, generation_index=g))
    bar = tqdm(total=len(order), desc="samples", unit="sample", disable=not cfg.progress, file=sys.stderr)
    done = engine.generate(requests, on_finish=lambda _: bar.update(1))
    bar.update(len(failed))
    bar.close()
    by_key = {(c.prompt_id, c.generation_index): c for c in done + failed}
    lines = []
    for key in order:
        lines.append(json.dumps(by_key[key].to_json()) + "\n")
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
        from engine import backend_is_cpu_only, start_kernel_build

        if backend_is_cpu_only():  # the compiler runs while JAX, the tokenizer and weights load
            start_kernel_build()
    return run_generate(cfg)
