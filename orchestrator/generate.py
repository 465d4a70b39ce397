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
from orchestrator.corpus import CorpusConfig, RawRow, Rejection, extract_prompt, row_id
from orchestrator.progress import format_prefix_cache


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


def explicit_engine_keys(argv: list[str]) -> frozenset[str]:
    """The engine.* keys given on the command line (`--engine.max_seqs=8` or `--engine.max_seqs 8`): sizing for
    the machine keeps them as given."""
    return frozenset(a.removeprefix("--engine.").split("=", 1)[0] for a in argv if a.startswith("--engine."))


def run_generate(cfg: GenerateConfig, explicit: frozenset[str] = frozenset()) -> int:
    """Generate for every input line. Engine capacities not in `explicit` are sized for this machine
    (engine/machine_sizing.py)."""
    from tqdm import tqdm

    from engine.engine import Completion, Engine
    from engine.machine_sizing import size_for_machine, this_machine
    from engine.model_config import ModelConfig
    from engine.sequence import Request

    for name in ("model", "input", "output"):
        if not getattr(cfg, name):
            print(f"pagefleet generate: --{name} is required", file=sys.stderr)
            return 2
    try:
        engine_cfg = size_for_machine(cfg.engine, ModelConfig.from_pretrained(cfg.model), cfg.dtype, this_machine(),
                                      explicit)
    except ValueError as e:
        print(f"pagefleet generate: {e}", file=sys.stderr)
        return 2
    engine = Engine(cfg.model, engine_cfg, dtype=cfg.dtype)
    sized = [k for k in ("max_pages", "max_seqs", "max_prefill_size") if k not in explicit]
    if sized:
        print("engine sized for this machine: " + ", ".join(f"{k}={getattr(engine_cfg, k):,}" for k in sized) +
              " (engine.kv_memory_gib or an explicit --engine.KEY overrides)", file=sys.stderr)
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
    summary = engine.stats.summary(engine_cfg.max_seqs)
    counters = {k: v for k, v in engine.snapshot().items()
                if k in ("num_preemptions", "num_multi_step_fallbacks", "num_pipelined_calls")}
    counters.update({f"engine_{k}": getattr(engine_cfg, k) for k in ("max_pages", "max_seqs", "max_prefill_size",
                                                                      "max_seqs_in_prefill")})
    print(f"wrote {len(lines)} samples to {cfg.output} ({errors} with errors)", file=sys.stderr)
    if summary["steps"]:
        print(f"{summary['steps']} steps in {summary['wall_s']:.2f} s (device calls {summary['device_s']:.2f} s, "
              f"host {summary['host_s']:.2f} s; step p50 {summary['step_ms_p50']:.1f} ms, "
              f"p90 {summary['step_ms_p90']:.1f} ms, max {summary['step_ms_max']:.1f} ms); "
              f"{summary['decode_tokens_per_s']:.1f} decode tok/s, {summary['prefill_tokens_per_s']:.1f} prefill tok/s; "
              f"slot occupancy mean {summary['mean_slot_occupancy']:.2f}, max {summary['max_slot_occupancy']:.2f}; "
              f"{counters['num_preemptions']} preemptions", file=sys.stderr)
    print(f"prefix cache: {format_prefix_cache(summary)}", file=sys.stderr)
    if cfg.stats_output:
        _write_atomically(Path(cfg.stats_output), [json.dumps({**summary, **counters}, indent=1) + "\n"])
    return 0


def main(argv: list[str]) -> int:
    cfg = draccus.parse(config_class=GenerateConfig, args=argv, prog="pagefleet generate")
    if cfg.engine.attention_impl in ("auto", "cpu_kernel") and cfg.dtype == "float32":
        from engine import kernel_build

        if kernel_build.backend_is_cpu_only():  # the compiler runs while JAX, the tokenizer and weights load
            kernel_build.start()
    return run_generate(cfg, explicit_engine_keys(argv))
