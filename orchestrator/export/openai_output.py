"""`pagefleet export --format openai_batch`: a run planned from an OpenAI Batch file (`corpus.format: openai_batch`,
plan/openai_batch.py) as OpenAI Batch output lines, one per request, in corpus order:

    {"id": "batch_req_000000000003", "custom_id": "r3", "response": {"status_code": 200, "request_id": "req_...",
     "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": ..., "model": ..., "choices": [{"index": 0,
     "message": {"role": "assistant", "content": "..."}, "finish_reason": "stop", "logprobs": null}],
     "usage": {"prompt_tokens": 24, "completion_tokens": 9, "total_tokens": 33}}}, "error": null}

A line's choices are its first n samples (its request's `n`; index = generation_index); `/v1/completions` lines get
a `text_completion` body. A rejected row (rejected.jsonl) is `{"response": null, "error": {"code": REASON,
"message": "REASON: DETAIL"}}`, its custom_id null when the line had no readable one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa

from orchestrator.json_out import dumps
from orchestrator.plan.openai_batch import REQUEST_COLUMN
from orchestrator.state.manifest import read_manifest
from orchestrator.state.rundir import RunDir

COLUMNS = ["row", "prompt_id", "generation_index", "completion", "token_ids", "finish_reason", "num_prompt_tokens",
           "passthrough"]
"""The sample columns the lines are made of."""

FINISH_REASONS = {"stop": "stop", "length": "length"}
"""pagefleet's finish_reason -> OpenAI's (EOS, a stop string or a completed structured output are all `stop`)."""


class BatchHeader:
    """What every line of one run shares: the run's model and when it finished."""

    def __init__(self, run_dir: RunDir):
        info = run_dir.read_run_json()
        if info["sample_affecting"].get("corpus", {}).get("format", "rows") != "openai_batch":
            raise ValueError(f"{run_dir.root} was not planned from an OpenAI Batch file (corpus.format: "
                             "openai_batch), so its rows are no Batch requests; export it without --format")
        self.model = str(info.get("config", {}).get("model", {}).get("path") or info.get("name"))
        finished = [r.finished_at for r in read_manifest(run_dir.manifest) if r.finished_at]
        self.created = int(max(finished)) if finished else 0
        self.rejected = [json.loads(line) for line in run_dir.rejected.read_text(encoding="utf-8").splitlines()
                         if line.strip()] if run_dir.rejected.exists() else []
        self.rejected.sort(key=lambda r: r["row"])


def batch_lines(tables: Iterator[pa.Table], header: BatchHeader) -> Iterator[str]:
    """The output lines of every row, accepted (`tables`: the samples in corpus order, then generation index) and
    rejected (header.rejected), in corpus order."""
    rejected = iter(header.rejected)
    pending = next(rejected, None)
    for samples in _rows(tables):
        row = samples[0]["row"]
        while pending is not None and pending["row"] < row:
            yield _error_line(pending)
            pending = next(rejected, None)
        yield _response_line(samples, header)
    while pending is not None:
        yield _error_line(pending)
        pending = next(rejected, None)


def _rows(tables: Iterator[pa.Table]) -> Iterator[list[dict]]:
    """The samples of one row at a time (a row's samples may span two tables)."""
    current: list[dict] = []
    for table in tables:
        for sample in table.to_pylist():
            if current and sample["row"] != current[0]["row"]:
                yield current
                current = []
            current.append(sample)
    if current:
        yield current


def _response_line(samples: list[dict], header: BatchHeader) -> str:
    first = samples[0]
    request = json.loads(first["passthrough"] or "{}").get(REQUEST_COLUMN) or {}
    kept = [s for s in samples if s["generation_index"] < request.get("n", 1)]
    chat = request.get("url", "/v1/chat/completions") == "/v1/chat/completions"
    prompt_tokens = first["num_prompt_tokens"]
    completion_tokens = sum(len(s["token_ids"] or ()) for s in kept)
    row = first["row"]
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{row:012d}",
        "object": "chat.completion" if chat else "text_completion",
        "created": header.created,
        "model": header.model,
        "choices": [_choice(s, chat) for s in kept],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    return dumps({"id": f"batch_req_{row:012d}", "custom_id": first["prompt_id"],
                  "response": {"status_code": 200, "request_id": f"req_{row:012d}", "body": body}, "error": None},
                 ensure_ascii=False)


def _choice(sample: dict, chat: bool) -> dict:
    finish = FINISH_REASONS[sample["finish_reason"]]
    if chat:
        return {"index": sample["generation_index"], "message": {"role": "assistant", "content": sample["completion"]},
                "finish_reason": finish, "logprobs": None}
    return {"index": sample["generation_index"], "text": sample["completion"], "finish_reason": finish,
            "logprobs": None}


def _error_line(rejected: dict) -> str:
    reason, row = rejected["reason"], rejected["row"]
    return dumps({"id": f"batch_req_{row:012d}", "custom_id": rejected.get("prompt_id"), "response": None,
                  "error": {"code": reason, "message": f"{reason}: {rejected.get('detail') or ''}"}},
                 ensure_ascii=False)
