"""`pagefleet generate`: the engine alone in one process, no Ray.

Input lines: {"id", "prompt"} | {"id", "messages"} | {"id", "prompt_token_ids"}, optionally with a
`sampling` object of per-line settings and any other columns (passed through to the line's records). A line with
`continuation` or `continuation_token_ids` is scored, one record per continuation (orchestrator/plan/continuation.py).
Output: one sample record per (prompt, generation_index) in input order (docs/records.md; `batch_id` is
null). A line that cannot run becomes a record with `error` set and no tokens: nothing is dropped.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import engine as lazy_engine  # Engine loads JAX on first use: `pagefleet run` imports this module's config
from engine import (EngineConfig, has_tokenizer, load_tokenizer, ModelConfig, Request, SampleRecord,
                    SamplingConfig, size_for_machine, SIZED_KEYS, structured_error, this_machine)
from orchestrator import exit_codes
from orchestrator.json_out import dumps
from orchestrator.observe.timeline import format_host_kv, format_prefix_cache, format_programs, format_transfers
from orchestrator.plan.chat import render_chat
from orchestrator.plan.corpus import CorpusConfig, RawRow, extract_prompt, passthrough, row_id
from orchestrator.plan.json_row import loads_row, lone_surrogate, without_bom
from orchestrator.plan.model_cache import local_copy
from orchestrator.plan.model_source import resolve_model, TOKENIZER_FILES
from orchestrator.plan.continuation import (encode_continuations, is_scored, new_tokens, row_continuations,
                                            scored_error, with_token_ids)
from orchestrator.plan.prompt_checks import out_of_vocabulary
from orchestrator.plan.rejection import Rejection
from orchestrator.plan.response_format import with_response_format
from orchestrator.plan.row_sampling import apply, row_overrides
from orchestrator.storage.atomic import atomic_write_text
from orchestrator.storage.readable import reading


@dataclass(frozen=True)
class GenerateConfig:
    model: str = ""
    """Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files), a `gs://` URL of one (read
    by ranged reads, nothing but the tokenizer copied; docs/storage.md), or a Hub id (`org/name`) already in the
    local Hub cache."""
    input: str = ""
    """JSON lines, one prompt each."""
    output: str = ""
    """Where the sample records go (JSON lines, written atomically)."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How each completion is sampled (the `sampling.*` keys of a run config)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's capacities and kernels (the `engine.*` keys of a run config)."""
    progress: bool = True
    """Show a progress bar on stderr."""
    stats_output: str | None = None
    """Also write the engine's performance summary and counters (steps, host and device seconds, tokens/s,
    slot occupancy, preemptions, ...) to this JSON file."""


# The generate input's fields, judged by the same rules as a run's corpus rows (orchestrator.plan.corpus).
_FIELDS = CorpusConfig(path="", id_field="id", text_field="prompt", messages_field="messages")


@dataclass(frozen=True)
class ParsedLine:
    """One input line as `generate` reads it; `error` set (and `token_ids` None) when it cannot run."""

    prompt_id: str | None
    """The line's id as a string (None when it has none)."""
    token_ids: list[int] | None = None
    error: str | None = None
    passthrough: str | None = None
    """SampleRecord.passthrough: the line's other columns and its typed id."""
    sampling: dict = field(default_factory=dict)
    """The line's own sampling overrides (its `sampling` object, orchestrator.plan.row_sampling)."""
    continuations: list[list[int]] | None = None
    """A scored line's continuations' token ids (`token_ids` is then their context), or None: sampled."""


def _parse_line(raw: bytes | dict, line_no: int, tokenizer, vocab_size: int | None = None, tokenizer_path: str = "",
                sampling: SamplingConfig = SamplingConfig()) -> ParsedLine:
    """One input line (its bytes, or the row already decoded, as `pagefleet.generate` passes it).

    Lines are judged as `pagefleet run` judges corpus rows, and an error names the same reasons as its
    rejected.jsonl: a line that is not UTF-8, not JSON or not an object, an empty prompt or message list, a
    field of the wrong type or no prompt field at all, a column named like a sample record field, a row nested
    too deeply to read, a chat the tokenizer has no template for, or a token id outside the model's vocabulary
    is an error record, never repaired or dropped."""
    if isinstance(raw, dict):
        row = raw
    else:
        try:
            row = loads_row(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            return ParsedLine(None, error=f"undecodable: line {line_no} is not UTF-8 ({e.reason} at byte {e.start})")
        except ValueError as e:
            return ParsedLine(None, error=f"malformed_row: line {line_no} is not valid JSON ({e})")
    if not isinstance(row, dict):
        return ParsedLine(None, error=f"malformed_row: line {line_no} is a JSON {type(row).__name__}, not an object")
    if (why := lone_surrogate(json.dumps(row, default=str))) is not None:
        return ParsedLine(None, error=f"undecodable: line {line_no}: {why}")
    pid = row_id(row, "id", None)
    if isinstance(pid, Rejection):
        return ParsedLine(None, error=f"{pid.reason}: {pid.detail}")
    kept = passthrough(row, "id")
    if isinstance(kept, Rejection):  # its record still names it by its id as typed
        typed = None if pid is None else json.dumps({"prompt_id": row["id"]}, ensure_ascii=False)
        return ParsedLine(pid, error=f"{kept.reason}: {kept.detail}", passthrough=typed)
    own = row_overrides(row.get("sampling"), sampling, "sampling")
    if not isinstance(own, Rejection):
        own = with_response_format(own, row.get("response_format"), "response_format", sampling)
    if isinstance(own, Rejection):
        return ParsedLine(pid, error=f"{own.reason}: {own.detail}", passthrough=kept)
    line = ParsedLine(pid, passthrough=kept, sampling=own)
    continuations = row_continuations(row) if is_scored(row) else None
    if isinstance(continuations, Rejection):
        return replace(line, error=f"{continuations.reason}: {continuations.detail}")
    parsed = extract_prompt(RawRow(line_no - 1, "", line_no, row), _FIELDS)
    if isinstance(parsed, Rejection):
        return replace(line, error=f"{parsed.reason}: {parsed.detail}")
    if parsed.token_ids is not None:  # bypasses the tokenizer ("prompt" or "messages" beside it are not read)
        found = (parsed.token_ids, None) if continuations is None else with_token_ids(parsed.token_ids, continuations)
        if isinstance(found, Rejection):
            return replace(line, error=f"{found.reason}: {found.detail}")
        return _in_vocabulary(line, *found, vocab_size)
    if tokenizer is None:
        return replace(line, error="the model directory has no tokenizer; give prompt_token_ids")
    text, special = parsed.text, True
    if parsed.messages is not None:  # the template writes its own special tokens
        text, special = render_chat(tokenizer, parsed.messages, tokenizer_path, kwargs=parsed.template_kwargs), False
        if isinstance(text, Rejection):
            return replace(line, error=f"{text.reason}: {text.detail}")
    encode = lambda t: tokenizer(t, add_special_tokens=special)["input_ids"]  # noqa: E731
    if continuations is not None:
        return _in_vocabulary(line, *encode_continuations(encode, text, continuations), vocab_size)
    return _in_vocabulary(line, encode(text), None, vocab_size)


def _in_vocabulary(line: ParsedLine, ids: list[int], continuations: list[list[int]] | None,
                   vocab_size: int | None) -> ParsedLine:
    why = out_of_vocabulary(ids + [t for c in continuations or () for t in c], vocab_size)
    if why is not None:
        return replace(line, error=f"out_of_vocabulary: {why}")
    return replace(line, token_ids=ids, continuations=continuations)


def parse_lines(lines: Iterable[tuple[int, bytes | dict]], tokenizer, vocab_size: int | None, sampling: SamplingConfig,
                tokenizer_path: str = "") -> list[tuple[int, ParsedLine]]:
    """Numbered input lines (bytes of a JSON line, or a row dict), each judged and tokenized (`_parse_line`)."""
    return [(line_no, _parse_line(raw, line_no, tokenizer, vocab_size, tokenizer_path, sampling))
            for line_no, raw in lines]


def longest_sequence(parsed: Iterable[tuple[int, ParsedLine]], sampling: SamplingConfig) -> int:
    """The most tokens a sequence of these lines can reach: its prompt plus its own max_new_tokens, or a scored line's
    context, longest continuation and the one token drawn after it (0: no line runs)."""
    return max((len(line.token_ids) + (apply(sampling, line.sampling).max_new_tokens if line.continuations is None
                                       else new_tokens(line.continuations))
                for _, line in parsed if line.token_ids is not None), default=0)


def workload_sequences(parsed: Iterable[tuple[int, ParsedLine]], sampling: SamplingConfig) -> int:
    """How many sequences these lines run in all: each sampled line's own `n`, each scored line one a continuation
    (an upper bound: slots past it would stay empty)."""
    return sum(apply(sampling, line.sampling).n if line.continuations is None else max(1, len(line.continuations))
               for _, line in parsed if line.token_ids is not None)


def model_tokenizer(model: str):
    """The tokenizer of a resolved model (a directory or a `gs://` URL), or None when it has none."""
    if "://" in model:
        return url_tokenizer(model)

    return load_tokenizer(model) if has_tokenizer(model) else None


def sized_engine(model: str, config: EngineConfig, dtype: str, explicit: frozenset[str],
                 lines: Iterable[tuple[int, bytes | dict]], sampling: SamplingConfig):
    """A new engine for a resolved `model`, its capacities not in `explicit` sized for this machine and for these
    numbered input lines (engine/sizing/machine_sizing.py: the pool holds what the input's longest sequence needs in every
    slot, no more). Returns (engine, the lines parsed with the model's tokenizer, loaded once). Raises ValueError
    naming the key to set when the budget cannot hold one sequence."""
    tokenizer, model_cfg = model_tokenizer(model), ModelConfig.from_pretrained(model)
    parsed = parse_lines(lines, tokenizer, model_cfg.vocab_size, sampling, model)
    engine = machine_sized_engine(model, config, dtype, explicit, longest_sequence(parsed, sampling), tokenizer,
                                  model_cfg, sequences=workload_sequences(parsed, sampling))
    return engine, parsed


def machine_sized_engine(model: str, config: EngineConfig, dtype: str, explicit: frozenset[str],
                         longest: int | None = None, tokenizer=None, model_cfg: ModelConfig | None = None,
                         sequences: int | None = None) -> lazy_engine.Engine:
    """A new engine for a resolved `model`, its capacities not in `explicit` sized for this machine
    (engine/sizing/machine_sizing.py); `longest`: the most tokens a sequence of the workload reaches, None when
    unknown (up to max_seq_len); `sequences`: how many sequences it runs in all, None when unknown. `tokenizer`
    and `model_cfg`, when the caller has them, are not read again.
    Raises ValueError naming the key to set when the budget cannot hold one sequence."""
    model_cfg = model_cfg if model_cfg is not None else ModelConfig.from_pretrained(model)
    cfg = size_for_machine(config, model_cfg, dtype, this_machine(), explicit, longest=longest, sequences=sequences)
    tokenizer = tokenizer if tokenizer is not None else model_tokenizer(model)
    return lazy_engine.Engine(model, cfg, dtype=dtype, tokenizer=tokenizer)


def sample_records(engine, parsed: Iterable[tuple[int, ParsedLine]], sampling: SamplingConfig,
                   on_finish: Callable[[], None] = lambda: None) -> list[dict]:
    """One sample record (docs/records.md, `batch_id` null) per (line, generation_index), in input order, for
    numbered parsed lines (`parse_lines`); a line that cannot run gives records with `error` set and no tokens.
    `on_finish` is called once per sample as it finishes."""
    requests, failed = [], []
    order: list[tuple[str, int]] = []
    first_line: dict[str, int] = {}
    kept: dict[str, str | None] = {}
    for line_no, line in parsed:
        pid, ids, err = line.prompt_id or f"line-{line_no}", line.token_ids, line.error
        kept_columns = line.passthrough
        if pid in first_line:  # a repeated id would make two prompts' samples indistinguishable
            ids, err = None, f"duplicate id {pid!r} (first on line {first_line[pid]})"
            pid = f"line-{line_no}"
            if kept_columns is not None:  # its record is named line-N: its own id must not rename it back
                kept_columns = json.dumps({k: v for k, v in json.loads(kept_columns).items() if k != "prompt_id"},
                                          ensure_ascii=False)
        first_line.setdefault(pid, line_no)
        kept[pid] = kept_columns
        if ids is not None and line.continuations is not None:
            err = scored_error(apply(sampling, line.sampling))
            for g, continuation in enumerate(line.continuations):  # one scored record per continuation
                order.append((pid, g))
                if err is not None:
                    failed.append(SampleRecord(pid, g, "", [], None, None, 0, error=err))
                else:
                    requests.append(Request(pid, tuple(ids) + tuple(continuation), apply(sampling, line.sampling),
                                            generation_index=g, num_context_tokens=len(ids)))
            continue
        for g in range(sampling.n):
            order.append((pid, g))
            if ids is None:
                failed.append(SampleRecord(pid, g, "", [], None, None, 0, error=err))
            else:
                requests.append(Request(pid, tuple(ids), apply(sampling, line.sampling), generation_index=g))
    done = engine.generate(requests, on_finish=lambda _: on_finish())
    for _ in failed:
        on_finish()
    by_key = {(c.prompt_id, c.generation_index): c for c in done + failed}
    return [replace(by_key[key], passthrough=kept[key[0]]).to_json() for key in order]


def _write_atomically(path: Path, lines: list[str]) -> None:
    """Atomically, with the user's umask (orchestrator.storage.atomic), like every file pagefleet writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(lines))


def explicit_engine_keys(argv: list[str]) -> frozenset[str]:
    """The engine.* keys given on the command line (`--engine.max_seqs=8` or `--engine.max_seqs 8`): sizing for
    the machine keeps them as given."""
    return frozenset(a.removeprefix("--engine.").split("=", 1)[0] for a in argv if a.startswith("--engine."))


def url_tokenizer(model: str):
    """For a `gs://` model: its tokenizer, from its tokenizer files copied once to the local cache (transformers reads
    a directory; the weights are read by ranged reads, never copied). None for a local model (the Engine loads it)
    or a bucket with no tokenizer files."""
    if "://" not in model:
        return None

    copy = local_copy(model, None, names=(*TOKENIZER_FILES, "config.json")).local_path
    return load_tokenizer(copy, local_files_only=True) if has_tokenizer(copy) else None


def run_generate(cfg: GenerateConfig, explicit: frozenset[str] = frozenset()) -> int:
    """Generate for every input line. Engine capacities not in `explicit` are sized for this machine
    (engine/sizing/machine_sizing.py)."""
    from tqdm import tqdm

    for name in ("model", "input", "output"):
        if not getattr(cfg, name):
            print(f"pagefleet generate: --{name} is required", file=sys.stderr)
            return exit_codes.FAULT
    model = resolve_model(cfg.model, "--model")
    with reading("--input", cfg.input, workers_read=False), open(cfg.input, "rb") as f:
        numbered = [(line_no, without_bom(line) if line_no == 1 else line) for line_no, line in enumerate(f, 1)
                    if line.strip()]
    try:
        with reading("--model", model, workers_read=False, only_under=True):  # its weights, config and tokenizer
            engine, parsed = sized_engine(model, cfg.engine, cfg.dtype, explicit, numbered, cfg.sampling)
    except ValueError as e:
        print(f"pagefleet generate: {e}", file=sys.stderr)
        return exit_codes.FAULT
    if cfg.sampling.structured is not None:  # the run's structured output: one line before any sample
        why = ("the model directory has no tokenizer" if engine.tokenizer is None
               else structured_error(engine.tokenizer, engine.vocab_size, cfg.sampling))
        if why is not None:
            print(f"pagefleet generate: {why}; fix it (it applies to every line)", file=sys.stderr)
            return exit_codes.FAULT
    engine_cfg = engine.config
    if engine.load_report["bytes_read"]:
        print(f"model read from {model} in {engine.load_report['load_s']:.1f} s "
              f"({engine.load_report['bytes_read']:,} bytes, ranged reads)", file=sys.stderr)
    sized = [k for k in SIZED_KEYS if k not in explicit]
    if sized:
        print("engine sized for this machine: " + ", ".join(f"{k}={getattr(engine_cfg, k):,}" for k in sized) +
              " (engine.kv_memory_gib or an explicit --engine.KEY overrides)", file=sys.stderr)
    total = sum(cfg.sampling.n if line.continuations is None else len(line.continuations) for _, line in parsed)
    bar = tqdm(total=total, desc="samples", unit="sample", disable=not cfg.progress, file=sys.stderr)
    records = sample_records(engine, parsed, cfg.sampling, on_finish=lambda: bar.update(1))
    bar.close()
    lines = [dumps(record) + "\n" for record in records]
    _write_atomically(Path(cfg.output), lines)
    errors = sum(1 for r in records if "error" in r)
    if records and errors == len(records):
        print(f"pagefleet generate: every one of the {len(records)} samples failed (the `error` of each record in "
              f"{cfg.output} says why)", file=sys.stderr)
    summary = {**engine.stats.summary(engine_cfg.max_seqs), **engine.programs()}  # its build's programs too
    counters = {k: v for k, v in engine.snapshot().items()
                if k in ("num_preemptions", "num_multi_step_fallbacks", "num_pipelined_calls", "num_swaps",
                         "num_swap_fallbacks")}
    counters.update({f"engine_{k}": getattr(engine_cfg, k) for k in (*SIZED_KEYS, "host_kv_pages")})
    print(f"wrote {len(lines)} samples to {cfg.output} ({errors} with errors)", file=sys.stderr)
    if summary["steps"]:
        print(f"{summary['steps']} steps in {summary['wall_s']:.2f} s (device calls {summary['device_s']:.2f} s, "
              f"host {summary['host_s']:.2f} s; step p50 {summary['step_ms_p50']:.1f} ms, "
              f"p90 {summary['step_ms_p90']:.1f} ms, max {summary['step_ms_max']:.1f} ms); "
              f"{summary['decode_tokens_per_s']:.1f} decode tok/s, {summary['prefill_tokens_per_s']:.1f} prefill tok/s; "
              f"slot occupancy mean {summary['mean_slot_occupancy']:.2f}, max {summary['max_slot_occupancy']:.2f}; "
              f"{counters['num_preemptions']} preemptions", file=sys.stderr)
    print(f"prefix cache: {format_prefix_cache(summary)}", file=sys.stderr)
    print(f"preemption: {format_host_kv(summary)}", file=sys.stderr)
    print(f"transfers: {format_transfers(summary)}", file=sys.stderr)
    print(f"programs: {format_programs(summary)}", file=sys.stderr)
    if cfg.stats_output:
        _write_atomically(Path(cfg.stats_output), [dumps({**summary, **counters}, indent=1) + "\n"])
    return exit_codes.FAULT if records and errors == len(records) else exit_codes.OK
