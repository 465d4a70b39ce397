"""Reading the prompt corpus: files, shards, rows, and the fields that make a prompt.

A corpus is a file, a directory (searched recursively) or a glob of `.jsonl` (or `.ndjson`), `.json` and
`.parquet` files (corpus_files.py), local or any fsspec URL; files are taken in sorted order, and rows are numbered
0, 1, ... across them in that order (blank lines of JSON-lines files are not rows). A `.json` file
holds a JSON array of objects, one object, or JSON lines. Files are split into shards (byte ranges
cut at line ends, or groups of parquet row groups) that workers read in parallel.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from json.encoder import c_encode_basestring, c_make_encoder  # type: ignore[attr-defined]
from typing import Any, Literal

import fsspec

from engine import INT32_MAX, RESERVED_COLUMNS
from orchestrator.json_out import finite
from orchestrator.plan.chat import parse_messages, template_kwargs
from orchestrator.plan.corpus_files import file_kind
from orchestrator.plan.json_row import loads_row, lone_surrogate, may_hold_lone_surrogate, without_bom
from orchestrator.plan.rejection import Rejection, a_type, text_value
from orchestrator.storage.readable import reading


@dataclass(frozen=True)
class CorpusConfig:
    path: str = "data/prompts.jsonl"
    """File, directory or glob of .jsonl (or .ndjson) / .json / .parquet files, suffixes in any case (a file compressed
    whole, like .jsonl.gz, is refused by name; names starting with "." or "_" below a directory are left out, with a
    warning, unless a glob spells them); local or an fsspec URL (gs://...)."""
    format: Literal["rows", "openai_batch"] = "rows"
    """`rows`: each row a prompt in the fields below. `openai_batch`: each row an OpenAI Batch request line
    (`{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`), its custom_id the id, its body's
    messages, sampling keys and response_format the row's (the *_field keys below do not apply); `pagefleet export
    --format openai_batch` writes the Batch output lines (docs/records.md)."""
    id_field: str | None = "id"
    """Field holding a stable prompt id (string or integer); rows without one get their row number."""
    text_field: str | None = "prompt"
    """Field holding a raw prompt (tokenized as is, with the tokenizer's default special tokens); a row has
    this field or messages_field, not both."""
    messages_field: str | None = "messages"
    """Field holding a chat (a list of {role, content} messages, OpenAI's chat format) rendered with the tokenizer's
    chat template as vLLM renders it (docs/records.md, Chats)."""
    token_ids_field: str | None = "prompt_token_ids"
    """Field holding a prompt already tokenized (a list of token ids, as vLLM's TokensPrompt): used as it is, no
    tokenizer and no special tokens added; a row with it has its text_field or messages_field read by nobody."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template, for every chat row, as vLLM's `chat_template_kwargs` (`{enable_thinking:
    false}`: Qwen3's non-thinking mode); a row's own (chat_template_kwargs_field) override them key by key. A key the
    template does not read is refused at the start (a row's own such keys are left out, as vLLM leaves them)."""
    chat_template_kwargs_field: str | None = "chat_template_kwargs"
    """Field holding a chat row's own chat_template_kwargs (an object; a text row's is not read)."""
    sampling_field: str | None = "sampling"
    """Field holding a row's own sampling settings, an object of `sampling.*` keys (all but `n`) that override the
    run's for that row (docs/records.md); rows without it use the run's."""
    response_format_field: str | None = None
    """Field holding a row's OpenAI-style response_format (`{"type": "json_schema", "json_schema": {"schema": ...}}`,
    `{"type": "json_object"}` or `{"type": "text"}`): that row's structured output, replacing the run's
    sampling.json_schema / regex / choice / grammar (docs/structured-outputs.md); null reads none."""
    shard_bytes: int = 16 * 2**20
    """Target bytes per shard read by one worker task (does not change the plan)."""
    in_process_bytes: int = 16 * 2**20
    """A corpus of at most this many bytes (as stored) is read and tokenized in the head's own process rather than by
    Ray tasks on the cluster's workers (which start Ray if it is not running, and load the tokenizer in each worker);
    0: always on the cluster. The same code runs either way: the plan is the same."""
    window_rows: int = 1_000_000
    """Rows the head plans at a time, at most: it tokenizes, packs and writes the batches of one window of consecutive
    rows before the next, so its memory follows the window, not the corpus's size. Prompts pack (and share prefixes)
    within their window; the samples do not depend on it."""
    window_bytes: int = 2**29
    """Corpus bytes (as stored) a planning window holds, at most, at the corpus's average bytes per row: long prompts
    make windows of fewer rows than corpus.window_rows (their token ids and page keys grow with their length)."""

    def __post_init__(self) -> None:
        for name in ("window_rows", "window_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"corpus.{name} must be at least 1, got {getattr(self, name)}")
        if isinstance(why := template_kwargs(self.chat_template_kwargs, "corpus.chat_template_kwargs"), Rejection):
            raise ValueError(why.detail)


@dataclass(frozen=True)
class Shard:
    """A piece of one file read by one task; `first_row`/`first_line` are set after counting."""

    file: str  # full URL or local path
    kind: str  # "jsonl" | "json" | "parquet"
    start: int = 0  # jsonl: byte offset; parquet: first row group
    end: int = -1  # jsonl: byte end (exclusive); parquet: row group end; -1: to the end
    first_row: int = 0
    first_line: int = 1
    file_index: int = 0  # position of `file` in the sorted corpus file list
    window_start: int = 0  # the rows read now: those of the planning window [window_start, window_end)
    window_end: int = -1  # -1: to the shard's end


# RawRow and Prompt (as Rejection) are made for every row of the corpus: slotted, not frozen (a frozen dataclass sets
# each field through object.__setattr__: ~0.6 against ~0.1 us a RawRow). Nothing changes them after they are made.
@dataclass(slots=True)
class RawRow:
    row: int
    """Row number in corpus order."""
    file: str
    line: int | None
    """1-based line in the file (JSON lines only)."""
    record: Any = None
    """The decoded row (a dict when well formed)."""
    reason: str | None = None
    detail: str | None = None


@dataclass(slots=True)
class Prompt:
    prompt_id: str
    text: str | None = None
    messages: list[dict] | None = None
    template_kwargs: dict | None = None
    """A chat's chat_template_kwargs: the run's with the row's own over them (chat.render_chat)."""
    token_ids: list[int] | None = None
    """A prompt given as token ids (token_ids_field)."""


def split_shards(files: list[str], shard_bytes: int) -> list[Shard]:
    """Cut files into shards of about `shard_bytes`; JSON-lines ranges end just after a newline."""
    shards: list[Shard] = []
    for index, url in enumerate(files):
        kind = file_kind(url)
        if kind == "parquet":
            import pyarrow.parquet as pq

            with _open(url) as f:
                meta = pq.ParquetFile(f).metadata
            start, size = 0, 0
            for g in range(meta.num_row_groups):
                size += meta.row_group(g).total_byte_size
                if size >= shard_bytes or g == meta.num_row_groups - 1:
                    shards.append(Shard(url, "parquet", start, g + 1, file_index=index))
                    start, size = g + 1, 0
            if meta.num_row_groups == 0:
                shards.append(Shard(url, "parquet", 0, 0, file_index=index))
        elif kind == "json":
            shards.append(Shard(url, "json", file_index=index))
        else:
            fs, path = fsspec.core.url_to_fs(url)
            total = fs.size(path)
            cuts = [0]
            with _open(url) as f:
                while cuts[-1] + shard_bytes < total:
                    f.seek(cuts[-1] + shard_bytes)
                    f.readline()  # move to just after the next newline
                    if f.tell() >= total:
                        break
                    cuts.append(f.tell())
            cuts.append(total)
            shards.extend(Shard(url, "jsonl", a, b, file_index=index) for a, b in zip(cuts, cuts[1:]))
    return shards


@contextmanager
def _open(url: str) -> Iterator:
    """A corpus file open for reading; a refusal, as it opens or as it is read (an object store's may come at the
    first read), names corpus.path, the file and the fix (readable.reading)."""
    fs, path = fsspec.core.url_to_fs(url)
    with reading("corpus.path", url), fs.open(path, "rb") as f:
        yield f


def _read_bytes(shard: Shard) -> bytes:
    """The shard's bytes (a file's first without a byte order mark: json_row.without_bom)."""
    with _open(shard.file) as f:
        if shard.kind == "jsonl":
            f.seek(shard.start)
            data = f.read(shard.end - shard.start)
            return without_bom(data) if shard.start == 0 else data
        return without_bom(f.read())


def _json_document(data: bytes) -> list | None:
    """A .json file's rows when it is one JSON document, None when it is JSON lines."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # not one document: read as lines, judged one by one
        return None
    return doc if isinstance(doc, list) else [doc]


def count_rows(shard: Shard) -> tuple[int, int]:
    """(rows, lines) in a shard; lines counts every newline-separated line (JSON lines only)."""
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        with _open(shard.file) as f:
            meta = pq.ParquetFile(f).metadata
        return sum(meta.row_group(g).num_rows for g in range(shard.start, shard.end)), 0
    data = _read_bytes(shard)
    if shard.kind == "json" and (doc := _json_document(data)) is not None:
        return len(doc), 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return sum(1 for line in lines if line.strip()), len(lines)


def read_rows(shard: Shard) -> Iterator[RawRow]:
    """The shard's rows in order, numbered from `shard.first_row`; bad rows carry a reason."""
    row = shard.first_row
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        with _open(shard.file) as f:
            pf = pq.ParquetFile(f)
            for g in range(shard.start, shard.end):
                for record in pf.read_row_group(g).to_pylist():
                    yield RawRow(row, shard.file, None, record)
                    row += 1
        return
    data = _read_bytes(shard)
    if shard.kind == "json" and (doc := _json_document(data)) is not None:
        for record in doc:
            if isinstance(record, dict) and (why := lone_surrogate(json.dumps(record))) is not None:
                yield RawRow(row, shard.file, None, None, "undecodable", why)
            elif isinstance(record, dict):
                yield RawRow(row, shard.file, None, record)
            else:
                yield RawRow(row, shard.file, None, None, "malformed_row", f"row is a JSON {type(record).__name__}, not an object")
            row += 1
        return
    try:  # the shard at once when it is all UTF-8 (almost always): its lines are then texts already
        whole = data.decode("utf-8")
    except UnicodeDecodeError:
        whole = None
    lines = data.split(b"\n") if whole is None else whole.split("\n")
    surrogates = whole is None or may_hold_lone_surrogate(whole)  # the cheap test once for the shard, not a row
    for offset, raw in enumerate(lines):
        if not raw.strip(None if whole is None else _ASCII_SPACE):  # blank as bytes.strip() sees it
            continue
        line = shard.first_line + offset
        try:
            text = raw if whole is not None else raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawRow(row, shard.file, line, None, "undecodable", f"line is not UTF-8: {e.reason} at byte {e.start}")
        else:
            try:
                record = loads_row(text)
            except ValueError as e:
                yield RawRow(row, shard.file, line, None, "malformed_row", f"not valid JSON: {e}")
            else:
                if surrogates and isinstance(record, dict) and (why := lone_surrogate(text)) is not None:
                    yield RawRow(row, shard.file, line, None, "undecodable", why)
                elif isinstance(record, dict):
                    yield RawRow(row, shard.file, line, record)
                else:
                    yield RawRow(row, shard.file, line, None, "malformed_row",
                                 f"row is a JSON {type(record).__name__}, not an object")
        row += 1


_ASCII_SPACE = " \t\n\r\x0b\x0c"
"""What `bytes.strip()` removes: a line of other (Unicode) spaces is a row, as it was when lines were bytes."""


def window_shards(shards: list[Shard], counts: list[tuple[int, int]], start: int, end: int) -> list[Shard]:
    """The numbered shards holding rows [start, end), each reading only those rows (a shard across a window's edge is
    read by both windows, each keeping its own rows)."""
    return [replace(s, window_start=start, window_end=end) for s, (rows, _) in zip(shards, counts)
            if rows and s.first_row < end and s.first_row + rows > start]


def in_window(shard: Shard, row: int) -> bool:
    return shard.window_start <= row and (shard.window_end < 0 or row < shard.window_end)


def number_shards(shards: list[Shard], counts: list[tuple[int, int]]) -> list[Shard]:
    """Give each shard its first row (corpus-wide) and first line (within its file)."""
    out, row, line, last_file = [], 0, 1, None
    for shard, (rows, lines) in zip(shards, counts):
        if shard.file != last_file:
            line, last_file = 1, shard.file
        out.append(replace(shard, first_row=row, first_line=line))
        row += rows
        line += lines
    return out


def row_id(record: dict, id_field: str | None, default: str | None) -> str | None | Rejection:
    """The row's id as a string (a string or integer field), `default` when it has none."""
    if not id_field or record.get(id_field) is None:
        return default
    value = record[id_field]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return Rejection("wrong_type", f"field {id_field!r} is {a_type(value)}, not a string or integer")
    return str(value)


_PASSTHROUGH = c_make_encoder(None, str, c_encode_basestring, None, ": ", ", ", False, False, False) if c_make_encoder \
    else json.JSONEncoder(default=str, allow_nan=False, ensure_ascii=False, check_circular=False).iterencode
"""`json.dumps(..., default=str, allow_nan=False, ensure_ascii=False)` as chunks: CPython's C encoder built once, not once
a row as `json.dumps` builds it (0.65 against 1.35 us for a short prompt's row). No check for cycles: a row read from JSON
or parquet has none."""


def passthrough(record: dict, id_field: str | None) -> str | Rejection:
    """The row's columns to pass through to its samples (`SampleRecord.passthrough`): every column but the id
    column, plus `prompt_id` holding the id as typed (when the row has one), as JSON object text. A value JSON
    cannot hold (a parquet timestamp, bytes) is written as its text. A column named like a field of the sample
    record rejects the row (`reserved_column`): its value would be lost in the output."""
    clash = [] if RESERVED_COLUMNS.isdisjoint(record) else sorted(
        name for name in record if name != id_field and name in RESERVED_COLUMNS)
    if clash:
        return Rejection("reserved_column", f"column {clash[0]!r} has the name of a sample record field (its output "
                                            f"would hide it); rename the column in the input (reserved: "
                                            f"{', '.join(sorted(RESERVED_COLUMNS))})")
    typed_id = record.get(id_field) if id_field else None
    kept = {} if typed_id is None else {"prompt_id": typed_id}
    for name, value in record.items():
        if name != id_field:
            kept[name] = value
    try:
        return "".join(_PASSTHROUGH(kept, 0))
    except ValueError:  # NaN or infinity in a column: JSON has none, so null (as every JSON pagefleet writes)

        return json.dumps(finite(kept), default=str, ensure_ascii=False)


def extract_prompt(raw: RawRow, config: CorpusConfig) -> Prompt | Rejection:
    """The prompt a well-formed row holds, or why the row cannot be used."""
    if raw.reason is not None:
        return Rejection(raw.reason, raw.detail or "")
    record = raw.record
    prompt_id = row_id(record, config.id_field, str(raw.row))
    if isinstance(prompt_id, Rejection):
        return prompt_id
    if config.token_ids_field and record.get(config.token_ids_field) is not None:
        ids = token_ids_value(record[config.token_ids_field], config.token_ids_field)
        return ids if isinstance(ids, Rejection) else Prompt(prompt_id, token_ids=ids)
    has_messages = bool(config.messages_field) and record.get(config.messages_field) is not None
    has_text = bool(config.text_field) and record.get(config.text_field) is not None
    if has_messages and has_text:
        return Rejection("malformed_row", f"row has both {config.text_field!r} and {config.messages_field!r}")
    if has_text:
        text = text_value(record[config.text_field], f"field {config.text_field!r}")
        if isinstance(text, Rejection):
            return text
        if not text.strip():
            return Rejection("empty_prompt", f"field {config.text_field!r} is empty")
        return Prompt(prompt_id, text=text)
    if has_messages:
        messages = parse_messages(record[config.messages_field], config.messages_field)
        if isinstance(messages, Rejection):
            return messages
        own = template_kwargs(record.get(config.chat_template_kwargs_field) if config.chat_template_kwargs_field
                              else None, f"field {config.chat_template_kwargs_field!r}")
        if isinstance(own, Rejection):
            return own
        kwargs = {**(config.chat_template_kwargs or {}), **(own or {})}
        return Prompt(prompt_id, messages=messages, template_kwargs=kwargs or None)
    names = [repr(f) for f in (config.text_field, config.messages_field, config.token_ids_field) if f]
    fields = " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"
    return Rejection("missing_field", f"row has no {fields} field")


def token_ids_value(value: Any, field: str) -> list[int] | Rejection:
    """A prompt given as token ids: a non-empty list of whole numbers (a tuple from Python callers), each a possible
    token id; returned as a list."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return Rejection("wrong_type", f"{field} must be a list of integers")
    if not value:
        return Rejection("empty_prompt", f"field {field!r} is an empty list")
    if (bad := next((t for t in value if not 0 <= t <= INT32_MAX), None)) is not None:
        return Rejection("out_of_vocabulary", f"{field} holds {bad}, which is no token id (0 to {INT32_MAX:,})")
    return list(value)
