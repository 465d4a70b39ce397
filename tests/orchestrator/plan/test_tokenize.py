import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.config import EngineConfig, SamplingConfig
from orchestrator.plan.continuation import encode_continuations
from orchestrator.plan.corpus import CorpusConfig, Shard, count_rows, number_shards, split_shards
from orchestrator.plan.model_source import ModelSourceConfig
from orchestrator.plan.packing import PackingConfig, PackingLimits
from orchestrator.plan.tokenize import PromptTokenizer


def stage(model, max_new_tokens=16, max_seq_len=64, max_pages=1024):
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(max_pages=max_pages), SamplingConfig(max_new_tokens=max_new_tokens))
    return PromptTokenizer(ModelSourceConfig(path=model), CorpusConfig(), limits, max_seq_len)


def test_text_and_chat_rows_match_transformers(tiny_model, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a poem about the sea"}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"id": "t", "prompt": "hello world"}) + "\n" + json.dumps({"id": "c", "messages": messages}) + "\n")
    table = stage(tiny_model, max_seq_len=256).tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert table[0]["token_ids"] == tok("hello world")["input_ids"]
    assert table[0]["token_ids"][0] == tok.bos_token_id
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert table[1]["token_ids"] == list(expected)
    assert [r["num_tokens"] for r in table] == [len(r["token_ids"]) for r in table]
    assert [r["prompt_id"] for r in table] == ["t", "c"] and table[1]["reason"] is None


def test_rows_given_as_token_ids_are_planned_as_given(tiny_model, tmp_path):
    """A corpus row may hold its prompt already tokenized (`prompt_token_ids`, as vLLM's TokensPrompt): planned as
    given (no special tokens added), in JSON lines and in parquet, as the same text's row is; ids beside a text win
    (as in `generate`); a bad list is a rejected row in one line, never repaired."""
    import pyarrow.parquet as pq

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok("hello world")["input_ids"]
    rows = [{"id": "text", "prompt": "hello world"}, {"id": "ids", "prompt_token_ids": ids},
            {"id": "both", "prompt": "not read", "prompt_token_ids": ids[1:]},
            {"id": "scored", "prompt_token_ids": ids, "continuation_token_ids": [[5, 6], [7]]},
            {"id": "textcont", "prompt_token_ids": ids, "continuation": " yes"},
            {"id": "bools", "prompt_token_ids": [True, 3]}, {"id": "floats", "prompt_token_ids": [5.0]},
            {"id": "empty", "prompt_token_ids": []}, {"id": "huge", "prompt_token_ids": [5, 2**40]},
            {"id": "oov", "prompt_token_ids": [5, len(tok) + 3]}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(max_pages=1024), SamplingConfig(max_new_tokens=16))
    stage_ids = PromptTokenizer(ModelSourceConfig(path=tiny_model), CorpusConfig(), limits, 256, vocab_size=len(tok))
    table = {r["prompt_id"]: r for r in stage_ids.tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size))
             .to_pylist()}
    assert table["text"]["token_ids"] == table["ids"]["token_ids"] == table["scored"]["token_ids"] == ids
    assert table["both"]["token_ids"] == ids[1:] and table["scored"]["continuations"] == [[5, 6], [7]]
    assert all(table[k]["reason"] is None for k in ("text", "ids", "both", "scored"))
    assert {k: (r["reason"], r["detail"]) for k, r in table.items() if r["reason"]} == {
        "textcont": ("bad_continuation", "a text 'continuation' is tokenized with its prompt's text; with prompt "
                                         "token ids give 'continuation_token_ids'"),
        "bools": ("wrong_type", "prompt_token_ids must be a list of integers"),
        "floats": ("wrong_type", "prompt_token_ids must be a list of integers"),
        "empty": ("empty_prompt", "field 'prompt_token_ids' is an empty list"),
        "huge": ("out_of_vocabulary", "prompt_token_ids holds 1099511627776, which is no token id (0 to "
                                      "2,147,483,647)"),
        "oov": ("out_of_vocabulary", table["oov"]["detail"])}
    assert str(len(tok) + 3) in table["oov"]["detail"]
    parquet = tmp_path / "c.parquet"
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("prompt_token_ids", pa.list_(pa.int64()))])
    pq.write_table(pa.Table.from_pylist([rows[0], rows[1]], schema=schema), parquet)
    got = stage_ids.tokenize_shard(Shard(str(parquet), "parquet", 0, 1)).to_pylist()
    assert [r["token_ids"] for r in got] == [ids, ids] and all(r["reason"] is None for r in got)


def test_too_long_and_over_budget_are_rejected_with_the_fix(tiny_model, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "the quick brown fox " * 20}) + "\n")
    shard = Shard(str(path), "jsonl", 0, path.stat().st_size)
    (row,) = stage(tiny_model, max_seq_len=64).tokenize_shard(shard).to_pylist()
    assert row["reason"] == "too_long" and "engine.max_seq_len" in row["detail"] and row["token_ids"] == []
    (row,) = stage(tiny_model, max_seq_len=4096, max_pages=2).tokenize_shard(shard).to_pylist()
    assert row["reason"] == "exceeds_budget" and "page_budget" in row["detail"]


LINES = [b'{"prompt": "hello world"}', b'{"id": "z", "messages": [{"role": "user", "content": "the sea"}]}', b"{broken",
         b'{"prompt": ""}', b'{"prompt": 3}', b'{"other": 1}', b'{"prompt": "\xff"}', b"", b"  ",
         b'{"prompt": "' + b"fox " * 200 + b'"}']


@settings(max_examples=25, deadline=None)
@given(picks=st.lists(st.integers(0, len(LINES) - 1), max_size=40), shard_bytes=st.integers(1, 400))
def test_every_line_is_one_row_with_one_outcome(tiny_model, tmp_path_factory, picks, shard_bytes):
    path = tmp_path_factory.mktemp("c") / "c.jsonl"
    path.write_bytes(b"\n".join(LINES[i] for i in picks))
    shards = split_shards([str(path)], shard_bytes)
    shards = number_shards(shards, [count_rows(s) for s in shards])
    tokenizer = stage(tiny_model, max_seq_len=96)
    table = pa.concat_tables([tokenizer.tokenize_shard(s) for s in shards]).to_pylist()
    non_blank = [i for i in picks if LINES[i].strip()]
    assert [r["row"] for r in table] == list(range(len(non_blank)))  # accepted + rejected = rows read
    for r in table:
        assert (r["reason"] is None) == (len(r["token_ids"]) == r["num_tokens"] > 0)
        assert r["file_index"] == 0 and r["line"] >= r["row"] + 1
    assert [r["reason"] is None for r in table] == [i in (0, 1) for i in non_blank]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_preset_tokenizers_render_chats_like_transformers(preset, tmp_path):
    from engine.models.presets import write_model

    model = str(write_model(preset, tmp_path / preset))
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"prompt": "hello world"}) + "\n")
    rows = stage(model, max_seq_len=2048).tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
    tok = AutoTokenizer.from_pretrained(model)
    assert rows[0]["token_ids"] == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert rows[1]["token_ids"] == tok("hello world")["input_ids"]


def test_rejected_rows_keep_their_valid_ids(tiny_model, tmp_path):
    """A row rejected for its prompt still names its own id in rejected.jsonl (not null); a row whose id
    itself is unusable, or that is not an object, has none."""
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join([json.dumps({"id": "empty", "prompt": ""}), json.dumps({"id": 7, "prompt": 3}),
                               json.dumps({"id": "long", "prompt": "the quick brown fox " * 40}),
                               json.dumps({"id": ["x"], "prompt": "hi"}), "[1]"]) + "\n")
    table = stage(tiny_model, max_seq_len=64).tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size))
    rows = table.to_pylist()
    assert [(r["prompt_id"], r["reason"]) for r in rows] == [
        ("empty", "empty_prompt"), ("7", "wrong_type"), ("long", "too_long"), (None, "wrong_type"), (None, "malformed_row")]


def test_rows_keep_their_columns_and_their_own_sampling_is_judged(tiny_model, tmp_path):
    """Items 10 and 12 when planning: an accepted row keeps its other columns and typed id (`passthrough`) and its
    validated `sampling` overrides; its own max_new_tokens judges its length; bad settings, a column named like a
    record field and a stop id outside the vocabulary reject the row with the reason."""
    rows = [{"id": 3, "prompt": "hello world", "meta": {"k": 1}, "sampling": {"max_new_tokens": 4, "top_k": 2}},
            {"id": "long", "prompt": "hello world", "sampling": {"max_new_tokens": 63}},
            {"id": "bad", "prompt": "hello world", "sampling": {"temperature": -1}},
            {"id": "clash", "prompt": "hello world", "finish_reason": "x"},
            {"id": "oov", "prompt": "hello world", "sampling": {"stop_token_ids": [100000]}},
            {"id": "plain", "prompt": "hello world"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = stage(tiny_model, max_new_tokens=16, max_seq_len=64)
    tokenizer.vocab_size = 400
    table = tokenizer.tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
    by = {r["prompt_id"]: r for r in table}
    assert by["3"]["reason"] is None and by["3"]["max_new_tokens"] == 4
    assert json.loads(by["3"]["passthrough"]) == {"prompt_id": 3, "prompt": "hello world", "meta": {"k": 1},
                                                  "sampling": {"max_new_tokens": 4, "top_k": 2}}
    assert json.loads(by["3"]["sampling"]) == {"max_new_tokens": 4, "top_k": 2}
    assert by["long"]["reason"] == "too_long" and "sampling.max_new_tokens=63" in by["long"]["detail"]
    assert by["bad"]["reason"] == "bad_sampling" and "sampling.temperature must be >= 0" in by["bad"]["detail"]
    assert by["clash"]["reason"] == "reserved_column" and "'finish_reason'" in by["clash"]["detail"]
    assert by["oov"]["reason"] == "out_of_vocabulary" and "stop_token_ids" in by["oov"]["detail"]
    assert by["plain"]["reason"] is None and by["plain"]["sampling"] is None and by["plain"]["max_new_tokens"] == 16
    assert all(r["passthrough"] is None and r["sampling"] is None for r in table if r["reason"])


def test_a_row_no_run_can_use_is_one_rejected_row_never_a_dead_shard(tiny_model, tmp_path):
    """Issue 41 items 3 and 7: a lone surrogate in any string of the row, a per-row max_new_tokens past int32, a
    temperature or top_p that is NaN or Infinity: each rejects its own row with one line naming it; the rows
    around it are tokenized as ever (before, the shard raised and the whole plan died)."""
    lines = ['{"id": "ok", "prompt": "hello world"}',
             '{"id": "lone", "prompt": "a\\ud800b"}',
             '{"id": "lone-column", "prompt": "hi", "note": "\\udfff"}',
             '{"id": "pair", "prompt": "smile \\ud83d\\ude00"}',
             '{"id": "huge", "prompt": "hi", "sampling": {"max_new_tokens": 2147483648}}',
             '{"id": "nan", "prompt": "hi", "sampling": {"temperature": NaN}}',
             '{"id": "inf", "prompt": "hi", "sampling": {"temperature": Infinity}}',
             '{"id": "top-p", "prompt": "hi", "sampling": {"top_p": NaN}}',
             '{"id": "ok2", "prompt": "hello again"}']
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines) + "\n")
    table = stage(tiny_model).tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
    got = [(r["prompt_id"], r["reason"]) for r in table]
    assert got == [("ok", None), (None, "undecodable"), (None, "undecodable"), ("pair", None), ("huge", "bad_sampling"),
                   ("nan", "bad_sampling"), ("inf", "bad_sampling"), ("top-p", "bad_sampling"), ("ok2", None)]
    assert "lone surrogate (\\ud800)" in table[1]["detail"] and "lone surrogate (\\udfff)" in table[2]["detail"]
    assert "sampling.max_new_tokens must be at most 2,147,483,647" in table[4]["detail"]
    assert table[5]["detail"].endswith("sampling.temperature must be a finite number, got nan")
    assert table[6]["detail"].endswith("sampling.temperature must be a finite number, got inf")
    assert all(len(r["detail"].splitlines()) == 1 for r in table if r["reason"])


def test_scored_rows_carry_their_continuations_and_what_cannot_be_scored_is_one_line(tiny_model, tmp_path):
    """A scored row's context and continuations are tokenized as `pagefleet generate` tokenizes them
    (continuation.encode_continuations); it is measured by its longest continuation; a bad continuation, or a
    continuation with sampling.n > 1 or with a structured output, is one rejected row with one line."""
    rows = [{"id": "s", "prompt": "the sea ", "continuation": ["is blue", " hello world"]},
            {"id": "t", "prompt": "hi", "continuation_token_ids": [5, 6, 7]},
            {"id": "empty", "prompt": "hi", "continuation": []},
            {"id": "both", "prompt": "hi", "continuation": "a", "continuation_token_ids": [5]},
            {"id": "rf", "prompt": "hi", "continuation": " a", "response_format": {"type": "json_object"}},
            {"id": "merged", "prompt": "hel", "continuation": "lo"},  # "hello" is one token: no continuation token
            {"id": "p", "prompt": "hi"}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shard = Shard(str(path), "jsonl", 0, path.stat().st_size)
    tokenizer = stage(tiny_model)
    tokenizer.corpus = CorpusConfig(response_format_field="response_format")
    table = {r["prompt_id"]: r for r in tokenizer.tokenize_shard(shard).to_pylist()}
    encode = lambda t: AutoTokenizer.from_pretrained(tiny_model)(t)["input_ids"]  # noqa: E731
    context, continuations = encode_continuations(encode, "the sea ", ["is blue", " hello world"])
    assert table["s"]["reason"] is None and table["s"]["token_ids"] == context
    assert table["s"]["continuations"] == continuations and table["s"]["num_continuations"] == 2
    assert table["s"]["max_new_tokens"] == 1 + max(map(len, continuations))
    # the second continuation computes the context's last page again (the context is shorter than a page: all of it)
    assert len(context) <= tokenizer.limits.page_size
    assert table["s"]["prefill_tokens"] == 2 * len(context) + sum(map(len, continuations))
    assert table["t"]["continuations"] == [[5, 6, 7]] and table["t"]["token_ids"] == encode("hi")
    assert table["p"]["continuations"] is None and table["p"]["num_continuations"] == 0
    for pid in ("empty", "both", "rf", "merged"):
        assert table[pid]["reason"] == "bad_continuation" and "\n" not in table[pid]["detail"], table[pid]
    assert table["rf"]["detail"].startswith("a scored row has no completion to constrain")
    assert table["merged"]["detail"].startswith("a scored row needs a context and a continuation of at least one")
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(max_pages=1024), SamplingConfig(n=2, max_new_tokens=16))
    two = PromptTokenizer(ModelSourceConfig(path=tiny_model), CorpusConfig(), limits, 64)
    table = {r["prompt_id"]: r for r in two.tokenize_shard(shard).to_pylist()}
    assert table["s"]["reason"] == "bad_continuation" and table["p"]["reason"] is None
    assert table["s"]["detail"].startswith("a row with a continuation is scored, one record per continuation; set "
                                           "sampling.n to 1 (it is 2)")


def test_a_rows_verdict_is_its_own_when_rows_of_its_length_came_before(tiny_model):
    """`check` remembers the verdict of a plain row by its length: a row of the same length with ids outside the
    vocabulary, or with its own max_new_tokens, still gets its own reason."""
    tokenizer = stage(tiny_model, max_seq_len=64)
    tokenizer.vocab_size = 100
    assert tokenizer.check([5, 6, 7]) is None
    assert tokenizer.check([5, 6, 700])[0] == "out_of_vocabulary"
    assert tokenizer.check([5, 6, 7], {"max_new_tokens": 62})[0] == "too_long"
    assert tokenizer.check([5, 6, 8]) is None
    assert tokenizer.check([5] * 60)[0] == "too_long"  # 60 + 16 new tokens > 64
    assert tokenizer.check([6] * 60)[0] == "too_long"


@pytest.mark.parametrize("vocab_size", ["all", "below_some", None])
def test_a_shards_ids_are_checked_against_the_vocabulary_row_by_row(tiny_model, tmp_path, vocab_size):
    """A shard's ids are checked against the model's vocabulary at once: every row whose ids all lie in it keeps
    exactly the tokenizer's ids, every other row is `out_of_vocabulary` with no ids, whichever rows sit beside it."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["hello world", "the quick brown fox", "a", "jumps over the lazy dog again and again", "sea"]
    ids = [tok(t)["input_ids"] for t in texts]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": t}) + "\n" for i, t in enumerate(texts)))
    tokenizer = stage(tiny_model, max_seq_len=256)
    limit = {"all": max(map(max, ids)) + 1, "below_some": sorted(map(max, ids))[2], None: None}[vocab_size]
    tokenizer.vocab_size = limit
    table = tokenizer.tokenize_shard(Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
    outside = [limit is not None and max(row) >= limit for row in ids]
    assert (vocab_size == "below_some") == any(outside) and not all(outside)
    for row, expected, out in zip(table, ids, outside):
        assert row["reason"] == ("out_of_vocabulary" if out else None), row
        assert row["token_ids"] == ([] if out else expected)
        assert row["num_tokens"] == len(expected)


def test_a_worker_builds_its_tokenizer_once_for_every_shard_of_a_plan(tiny_model, tmp_path, monkeypatch):
    """The task that tokenizes a shard on a Ray worker keeps the worker's tokenizer for the next shard (loading one
    reads its files: ~0.6 s), and builds another for other settings or other tokenizer files."""
    import pickle

    from orchestrator.plan import tokenized

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hello world " * (1 + i)}) + "\n" for i in range(4)))
    shard = Shard(str(path), "jsonl", 0, path.stat().st_size)
    built = []
    monkeypatch.setattr(tokenized, "PromptTokenizer", lambda *args: built.append(args) or PromptTokenizer(*args))
    monkeypatch.setattr(tokenized, "_TOKENIZER", {})
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(max_pages=1024), SamplingConfig(max_new_tokens=16))
    args = pickle.dumps(((ModelSourceConfig(path=tiny_model), CorpusConfig(), limits, 64), "digest"))
    tables = [tokenized.tokenize_on_worker(shard, args) for _ in range(3)]
    assert len(built) == 1 and all(t.equals(tables[0][0]) and rows == 4 for t, rows in tables)
    other = pickle.dumps(((ModelSourceConfig(path=tiny_model), CorpusConfig(), limits, 32), "digest"))
    tokenized.tokenize_on_worker(shard, other)
    assert len(built) == 2 and len(tokenized._TOKENIZER) == 1  # one tokenizer held at a time
    edited = pickle.dumps(((ModelSourceConfig(path=tiny_model), CorpusConfig(), limits, 32), "files changed"))
    tokenized.tokenize_on_worker(shard, edited)
    assert len(built) == 3  # the same settings, but the tokenizer's files changed since
