import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator.plan.corpus import (CorpusConfig, Prompt, Rejection, count_rows, extract_prompt, number_shards,
                                      read_rows, split_shards)
from orchestrator.plan.corpus_files import list_files


def rows_of(files, shard_bytes=10**9):
    shards = split_shards(files, shard_bytes)
    shards = number_shards(shards, [count_rows(s) for s in shards])
    return [r for s in shards for r in read_rows(s)]


def test_list_files_file_dir_glob(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.jsonl", "a.parquet", "sub/c.json", "notes.txt"):
        (tmp_path / name).write_text("")
    assert list_files(str(tmp_path)) == [str(tmp_path / n) for n in ("a.parquet", "b.jsonl", "sub/c.json")]
    assert list_files(str(tmp_path / "*.jsonl")) == [str(tmp_path / "b.jsonl")]
    assert list_files(f"file://{tmp_path}/b.jsonl")[0].endswith("b.jsonl")
    with pytest.raises(FileNotFoundError, match="corpus.path"):
        list_files(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unsupported"):
        list_files(str(tmp_path / "notes.txt"))


def test_a_compressed_corpus_file_is_refused_by_name_not_left_out(tmp_path):
    """A directory (or glob) of .jsonl files and .jsonl.gz ones planned the first and dropped the others unsaid."""
    (tmp_path / "sub").mkdir()
    for name in ("a.jsonl", "sub/b.jsonl.gz", "sub/c.json.zst", "d.txt.gz"):
        (tmp_path / name).write_text("")
    for path in (tmp_path, tmp_path / "*" / "*", tmp_path / "sub" / "c.json.zst"):
        with pytest.raises(ValueError, match=r"is compressed.*decompress them, convert them to parquet"):
            list_files(str(path))
    with pytest.raises(ValueError, match=r"sub/b.jsonl.gz is compressed \(and 1 more\)"):
        list_files(str(tmp_path))
    assert list_files(str(tmp_path / "*.jsonl")) == [str(tmp_path / "a.jsonl")]  # a glob leaves them out


def test_a_byte_order_mark_does_not_make_the_first_row_malformed(tmp_path):
    """A file saved with a UTF-8 byte order mark (Notepad, PowerShell) rejected its first row as malformed JSON."""
    rows = [{"id": f"r{i}", "prompt": f"prompt {i}"} for i in range(40)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "a.jsonl").write_text(lines, encoding="utf-8-sig")
    (tmp_path / "b.jsonl").write_text("\n" + lines, encoding="utf-8-sig")  # the mark alone on the first line
    (tmp_path / "c.json").write_text(json.dumps(rows), encoding="utf-8-sig")
    for name in ("a.jsonl", "b.jsonl", "c.json"):
        for shard_bytes in (64, 10**9):  # the mark in the first of many shards, or in the only one
            got = rows_of([str(tmp_path / name)], shard_bytes=shard_bytes)
            assert [r.record for r in got] == rows and all(r.reason is None for r in got), name


def test_a_linked_directory_is_read_once_and_a_loop_adds_no_file_twice(tmp_path):
    """A link to a directory was left out of a directory corpus without a word; followed, a link back up would list
    the same file once per level (41 times before the kernel refuses the path)."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.jsonl").write_text("")
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "a.jsonl").write_text("")
    (corpus / "a" / "up").symlink_to(corpus)  # a loop
    (corpus / "linked").symlink_to(tmp_path / "elsewhere")
    (corpus / "linked_again").symlink_to(tmp_path / "elsewhere")  # the same directory twice: its files once
    assert list_files(str(corpus)) == [str(corpus / "a" / "a.jsonl"), str(corpus / "linked" / "b.jsonl")]


def hidden_tree(root):
    """A corpus directory as Jupyter, macOS, a desktop, Spark and Delta leave it: stale copies, metadata, another's
    trash, a failed job's task files, a table's log."""
    for name, text in (("data.jsonl", '{"id": "a", "prompt": "new"}\n'),
                       (".ipynb_checkpoints/data-checkpoint.jsonl", '{"id": "a", "prompt": "stale"}\n'),
                       ("._data.jsonl", "\x00\x05\x16\x07"), (".DS_Store", ""), ("sub/.hidden.jsonl", ""),
                       ("sub/b.json", "[]"), (".Trash-1000/files/old.jsonl", ""), ("_SUCCESS", ""),
                       ("_temporary/0/_temporary/attempt_0/part-00000.jsonl", '{"id": "a", "prompt": "half"}\n'),
                       ("_delta_log/00000000000000000000.json", '{"commitInfo": {}}\n')):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_hidden_names_below_a_corpus_directory_are_left_out_and_named(tmp_path, caplog):
    """`.ipynb_checkpoints/data-checkpoint.jsonl` sorts before `data.jsonl`: its stale rows were planned, and the
    current ones rejected as duplicate ids (or, without ids, both sampled)."""
    hidden_tree(tmp_path)
    caplog.set_level("WARNING", logger="orchestrator.plan.corpus_files")
    for path in (tmp_path, tmp_path / "**", tmp_path / "*" / "*.json*"):
        caplog.clear()
        files = list_files(str(path))
        assert ".ipynb" not in " ".join(files) and "._" not in " ".join(files) and ".hidden" not in " ".join(files)
        assert "_temporary" not in " ".join(files) and "_delta_log" not in " ".join(files)
        assert str(tmp_path / "sub" / "b.json") in files or path == tmp_path / "*" / "*.json*"
        [warning] = caplog.messages
        assert "hidden" in warning and ".ipynb_checkpoints" in warning and "to read one, name it" in warning, warning
    caplog.clear()
    assert list_files(str(tmp_path)) == [str(tmp_path / "data.jsonl"), str(tmp_path / "sub" / "b.json")]
    assert "left out 6 hidden entries (a name starting with '.' or '_')" in caplog.messages[0]
    # Named, a hidden file or directory is read.
    caplog.clear()
    stale = str(tmp_path / ".ipynb_checkpoints" / "data-checkpoint.jsonl")
    assert list_files(str(tmp_path / ".ipynb_checkpoints" / "*.jsonl")) == [stale]
    assert list_files(stale) == [stale] and not caplog.messages
    half = str(tmp_path / "_temporary" / "0" / "_temporary" / "attempt_0" / "part-00000.jsonl")
    assert list_files(str(tmp_path / "_temporary" / "0" / "_temporary" / "*" / "*.jsonl")) == [half]


def test_hidden_names_in_a_bucket_are_left_out_and_named_as_in_a_local_directory(tmp_path, gcs_bucket, caplog):
    from tests.gcs_emulator import upload

    hidden_tree(tmp_path)
    url = upload(str(tmp_path), f"{gcs_bucket}/corpus")
    caplog.set_level("WARNING", logger="orchestrator.plan.corpus_files")
    assert list_files(url) == [f"{url}/data.jsonl", f"{url}/sub/b.json"]
    assert list_files(f"{url}/**") == [f"{url}/data.jsonl", f"{url}/sub/b.json"]
    assert len(caplog.messages) == 2
    assert all(".ipynb_checkpoints" in m and "._data.jsonl" in m for m in caplog.messages), caplog.messages
    stale = f"{url}/.ipynb_checkpoints/data-checkpoint.jsonl"
    assert list_files(f"{url}/.ipynb_checkpoints/*") == [stale]


def test_ndjson_and_upper_case_suffixes_are_corpus_files(tmp_path):
    """`.ndjson` (JSON lines by another name) and `.JSONL` were left out of a directory without a word."""
    (tmp_path / "a.ndjson").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    (tmp_path / "B.JSONL").write_text('{"id": "c", "prompt": "z"}\n')
    (tmp_path / "C.Parquet").write_bytes(b"")
    files = list_files(str(tmp_path))
    assert files == [str(tmp_path / n) for n in ("B.JSONL", "C.Parquet", "a.ndjson")]
    assert [s.kind for s in split_shards(files[::2], 2**20)] == ["jsonl", "jsonl"]
    assert [r.record["id"] for r in rows_of(files[::2], shard_bytes=2**20)] == ["c", "a", "b"]


def test_shards_number_rows_and_lines_like_one_pass(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = [json.dumps({"id": i, "prompt": "x" * (i % 13 + 1)}) for i in range(300)]
    lines[10] = ""  # a blank line is not a row
    path.write_text("\n".join(lines) + "\n")
    whole = rows_of([str(path)])
    pieces = rows_of([str(path)], shard_bytes=200)
    assert len(split_shards([str(path)], 200)) > 10
    assert [(r.row, r.line, r.record) for r in pieces] == [(r.row, r.line, r.record) for r in whole]
    assert [r.row for r in whole] == list(range(299)) and whole[10].line == 12


def test_json_and_parquet_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "one"}, {"prompt": "two"}, 3]))
    table = pa.table({"id": ["x", "y"], "messages": [[{"role": "user", "content": "hi"}], None], "prompt": [None, "yo"]})
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=1)
    (tmp_path / "c.json").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    rows = rows_of(list_files(str(tmp_path)), shard_bytes=1)
    assert [r.row for r in rows] == list(range(7))
    assert rows[2].reason == "malformed_row"
    cfg = CorpusConfig()
    assert extract_prompt(rows[3], cfg) == Prompt("x", messages=[{"role": "user", "content": ["hi"]}])  # its texts (chat.py)
    assert extract_prompt(rows[4], cfg) == Prompt("y", text="yo")
    assert extract_prompt(rows[6], cfg) == Prompt("6", text="b")


@pytest.mark.parametrize("line, reason", [
    (b"{not json", "malformed_row"),
    (b"[1, 2]", "malformed_row"),
    (b'{"prompt": "caf\xe9"}', "undecodable"),
    (b'{"text": "hi"}', "missing_field"),
    (b'{"prompt": 5}', "wrong_type"),
    (b'{"prompt": "x", "id": 1.5}', "wrong_type"),
    (b'{"messages": "hi"}', "wrong_type"),
    (b'{"messages": [{"role": "user"}]}', "wrong_type"),
    (b'{"prompt": "  "}', "empty_prompt"),
    (b'{"messages": []}', "empty_prompt"),
    (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "malformed_row"),
])
def test_bad_rows_have_reasons(tmp_path, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_bytes(line + b"\n")
    (raw,) = rows_of([str(path)])
    got = extract_prompt(raw, CorpusConfig())
    assert isinstance(got, Rejection) and got.reason == reason, got


@pytest.mark.parametrize("line, detail", [
    (b'{"prompt": 5}', "field 'prompt' is an int, not a string"),
    (b'{"prompt": "x", "id": 1.5}', "field 'id' is a float, not a string or integer"),
    (b'{"messages": "hi"}', "field 'messages' is a str, not a list"),
])
def test_type_errors_read_as_english(tmp_path, line, detail):
    path = tmp_path / "c.jsonl"
    path.write_bytes(line + b"\n")
    (raw,) = rows_of([str(path)])
    assert extract_prompt(raw, CorpusConfig()).detail == detail


def test_lines_read_the_same_from_a_utf8_shard_and_from_one_with_a_bad_line(tmp_path):
    """A shard that is all UTF-8 is decoded at once and split as text; one with a bad line is read line by line.
    Blank is what bytes.strip() removes (a line of Unicode spaces is a row), a line separator inside a string does
    not cut its line, and the lone-surrogate check still finds its row."""
    good = [b'{"id": "a", "prompt": "x\xe2\x80\xa8y"}', b"\r", b"\xc2\xa0", b'{"prompt": "\\ud800"}',
            b'{"prompt": "\\ud83d\\ude00"}', b"", b'{"id": 7, "prompt": "caf\xc3\xa9"}']
    seen = []
    for name, lines in (("utf8", good), ("mixed", good + [b'{"prompt": "caf\xe9"}'])):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        seen.append([(r.row, r.line, r.record, r.reason) for r in rows_of([str(path)])])
    utf8, mixed = seen
    assert mixed[:-1] == utf8 and mixed[-1][3] == "undecodable"
    assert [(row, line, reason) for row, line, _, reason in utf8] == [
        (0, 1, None), (1, 3, "malformed_row"), (2, 4, "undecodable"), (3, 5, None), (4, 7, None)]
    assert utf8[0][2] == {"id": "a", "prompt": "x\u2028y"} and utf8[3][2] == {"prompt": "\U0001F600"}
