import importlib.util
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "configs" / "data"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_demo_prompts", DATA / "make_demo_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_corpus_is_what_its_generator_writes():
    lines = (DATA / "demo_prompts.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == load_generator().make_rows(1200, seed=0)


def test_the_demo_corpus_rows_are_well_formed():
    rows = [json.loads(line) for line in (DATA / "demo_prompts.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 1000
    ids = [row["id"] for row in rows]
    assert all(isinstance(i, str) for i in ids) and len(set(ids)) == len(ids)
    assert ids[:16] == [f"demo-{i:02d}" for i in range(16)]  # the original rows keep their ids
    chats = [row for row in rows if "messages" in row]
    for row in rows:
        assert ("prompt" in row) != ("messages" in row), row["id"]
        assert set(row) <= {"id", "prompt", "messages"}, row["id"]
    for row in chats:
        assert row["messages"][-1]["role"] == "user" and all(m["content"] for m in row["messages"]), row["id"]
        assert {m["role"] for m in row["messages"]} <= {"system", "user", "assistant"}, row["id"]
    assert 0.25 < len(chats) / len(rows) < 0.45
    assert any(sum(m["role"] == "user" for m in row["messages"]) > 1 for row in chats)  # some multi-turn
