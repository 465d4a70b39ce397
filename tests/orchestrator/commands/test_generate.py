"""`pagefleet generate` as a user runs it: a subprocess on a model written by `init-model`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from engine.models.presets import write_model
from orchestrator.commands.generate import main as generate_main
from tests.engine.models.hf_reference import hf_greedy, varied_prompts

MIN_GAP = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("m"))


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**(os.environ if env is None else env), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_generate_writes_one_record_per_sample_in_input_order(tmp_path, model_dir):
    rows = ['{"id": "a", "prompt": "Hello there"}', '{"id": "b", "messages": [{"role": "user", "content": "hi"}]}',
            'not json', '{"id": "c", "prompt_token_ids": [5, 6, 7]}', '{"id": "d", "prompt": ""}',
            '{"id": "a", "prompt": "same id again"}']
    # With the byte order mark some editors write (Notepad, PowerShell): line 1 is still a row, not malformed JSON.
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8-sig")
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                   "--sampling.max_new_tokens=6", "--sampling.n=2", "--sampling.temperature=0.7",
                   "--sampling.logprobs=true", "--engine.max_seq_len=256", "--engine.max_pages=32", "--progress=false")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == [
        (p, g) for p in ["a", "b", "line-3", "c", "d", "line-6"] for g in (0, 1)]
    by = {(r["prompt_id"], r["generation_index"]): r for r in records}
    assert by[("line-6", 0)]["error"] == "duplicate id 'a' (first on line 1)"
    assert by[("line-3", 0)]["error"].startswith("malformed_row: line 3 is not valid JSON")
    assert by[("d", 1)]["error"] == "empty_prompt: field 'prompt' is empty"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert by[("b", 0)]["num_prompt_tokens"] == len(tok(chat, add_special_tokens=False)["input_ids"])
    for key in [("a", 0), ("a", 1), ("b", 0), ("c", 1)]:
        r = by[key]
        assert r["finish_reason"] in ("stop", "length") and 1 <= len(r["token_ids"]) <= 6
        assert len(r["logprobs"]) == len(r["token_ids"]) and all(lp <= 0 for lp in r["logprobs"])
    assert by[("a", 0)]["token_ids"] != by[("a", 1)]["token_ids"]  # two samples, two random streams


def test_generate_reports_the_prefix_cache_counters(tmp_path, model_dir, capsys):
    """Three prompts behind one 40-token block: the second and third map the first's two full 16-token pages, and
    the counters reach the summary line and --stats_output with their hit rate."""
    block = list(range(10, 50))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": block + [60 + i]}) + "\n"
                                               for i in range(3)))
    stats_file = tmp_path / "stats.json"
    assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "out.jsonl"), "--stats_output", str(stats_file), "--progress=false",
                          "--sampling.max_new_tokens=4", "--engine.max_seq_len=64", "--engine.max_pages=32",
                          "--engine.page_size=16"]) == 0
    stats = json.loads(stats_file.read_text())
    assert (stats["prefix_cache_query_tokens"], stats["prefix_cache_hit_tokens"]) == (3 * 41, 2 * 32)
    assert stats["prefix_cache_hit_rate"] == 64 / 123
    assert "prefix cache: 64 of 123 prompt tokens served from cached pages (52.0% hit rate)" in capsys.readouterr().err


def test_generate_reports_the_bytes_moved_between_host_and_device(tmp_path, model_dir, capsys):
    """The transfer ledger's figures reach --stats_output (by category, total, per generated token) and the
    summary's `transfers:` line; the KV pool and the logits never cross, nor anything reserved."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": [5 + i, 6, 7]}) + "\n"
                                               for i in range(3)))
    stats_file = tmp_path / "stats.json"
    assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "out.jsonl"), "--stats_output", str(stats_file), "--progress=false",
                          "--sampling.max_new_tokens=4", "--engine.max_seq_len=64", "--engine.max_pages=32"]) == 0
    stats = json.loads(stats_file.read_text())
    d2h = {c: stats[f"device_to_host_bytes_{c}"] for c in ("tokens", "logprobs", "steps", "logits", "stats", "swap")}
    assert stats["device_to_host_bytes"] == sum(d2h.values()) and d2h["tokens"] > 0 and d2h["logprobs"] > 0
    assert d2h["logits"] == d2h["stats"] == d2h["swap"] == 0
    assert 0 < stats["device_to_host_bytes_per_token"] <= stats["device_to_host_bytes"]
    assert stats["host_to_device_bytes"] >= stats["host_to_device_bytes_page_tables"] > 0
    err = capsys.readouterr().err
    assert (f"transfers: device to host {stats['device_to_host_bytes']:,} B (tokens {d2h['tokens']:,}, "
            f"logprobs {d2h['logprobs']:,}") in err
    assert f"{stats['device_to_host_bytes_per_token']:,.1f} B per generated token; host to device" in err


def test_a_later_process_loads_the_programs_the_first_one_compiled(tmp_path, model_dir):
    """The compile cache as docs/caches.md promises it: a second `pagefleet generate` on a fresh machine's cache
    compiles nothing and loads what the first compiled (same samples), and both say so (`programs:`)."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt": f"the ocean {i}"}) + "\n"
                                               for i in range(4)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the test session's own
    env["PAGEFLEET_COMPILE_CACHE"] = str(tmp_path / "cache")
    kernels = Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) / "kernels"  # the CPU kernels, built once a session
    if kernels.is_dir():  # they live beside the programs; not what this test is about
        shutil.copytree(kernels, tmp_path / "cache" / "kernels")
    stats, outputs = [], []
    for run in range(2):
        out, stats_file = tmp_path / f"out{run}.jsonl", tmp_path / f"stats{run}.json"
        proc = run_cli("generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                       str(out), "--stats_output", str(stats_file), "--progress=false", "--sampling.max_new_tokens=5",
                       "--sampling.temperature=0.7", "--engine.max_seq_len=64", "--engine.max_pages=24", env=env)
        assert proc.returncode == 0, proc.stderr
        stats.append(json.loads(stats_file.read_text()))
        outputs.append(out.read_text())
        figures = stats[-1]
        assert (f"programs: {figures['programs_compiled']:,} compiled ({figures['compile_s']:.1f} s), "
                f"{figures['programs_loaded']:,} loaded from the compile cache") in proc.stderr
    first, second = stats
    assert first["programs_compiled"] >= 2 and first["programs_loaded"] == 0 and first["compile_s"] > 0
    assert (second["programs_compiled"], second["programs_loaded"]) == (0, first["programs_compiled"])
    assert second["trace_lower_s"] > 0  # what a warm cache still costs: each program traced and lowered
    assert outputs[0] == outputs[1]


def test_generate_reports_swap_preemption(tmp_path, model_dir, capsys):
    """A pool too small for six 40-token generations, engine.preemption=swap: pages go out and in, nothing is
    recomputed, the host pool's bytes are in the ledger's `swap` category, and the summary has a `preemption:` line."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": [5 + i, 6, 7, 8, 9]}) + "\n"
                                               for i in range(6)))
    stats_file = tmp_path / "stats.json"
    assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "out.jsonl"), "--stats_output", str(stats_file), "--progress=false",
                          "--sampling.max_new_tokens=40", "--engine.max_seq_len=64",
                          "--engine.page_size=4", "--engine.max_pages=24", "--engine.max_seqs=6", "--engine.host_kv_pages=64",
                          "--engine.preemption=swap"]) == 0
    stats = json.loads(stats_file.read_text())
    assert stats["num_preemptions"] == stats["num_swaps"] > 0 and stats["num_swap_fallbacks"] == 0
    assert stats["kv_pages_out"] >= stats["kv_pages_in"] > 0 and stats["recompute_tokens"] == 0
    assert 0 < stats["host_kv_pages_peak"] <= 64 == stats["engine_host_kv_pages"]
    assert stats["recompute_avoided_tokens"] > 0
    assert stats["device_to_host_bytes_swap"] > 0 and stats["host_to_device_bytes_swap"] > 0
    assert (f"preemption: {stats['kv_pages_out']:,} KV pages swapped out, {stats['kv_pages_in']:,} in; recompute of "
            f"{stats['recompute_avoided_tokens']:,} tokens avoided, 0 tokens dropped for recompute"
            in capsys.readouterr().err)


def test_generate_sizes_the_engine_for_the_machine_and_its_input_and_keeps_explicit_keys(tmp_path, model_dir, capsys):
    """No capacity flags: a budget from engine.kv_memory_gib (tiny-llama: 2 layers * K,V * 2 kv heads * 16 dims *
    4 bytes = 512 bytes a token, 8 KiB a page of 16) of 131 pages; the input's longest sequence (a 40-token prompt
    plus 4 new tokens: 3 pages) sets the slots (131 // 3 = 43: 32, a power of two) and the pool is what those slots
    can use at once (32 * 3 = 96 pages), not the whole budget (60 sequences would fill 64 slots); 4,096-token steps;
    an explicit --engine.max_seqs is kept and the pool follows it."""
    prompts = [[5 + i, 6, 7] for i in range(59)] + [list(range(3, 43))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p}) + "\n"
                                               for i, p in enumerate(prompts)))
    stats_file = tmp_path / "stats.json"
    args = ["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--stats_output", str(stats_file), "--progress=false", "--sampling.max_new_tokens=4",
            "--engine.max_seq_len=128", "--engine.kv_memory_gib=0.001"]
    assert generate_main(args) == 0
    stats = json.loads(stats_file.read_text())
    assert 2**30 // 1000 // (16 * 512) == 131
    assert (stats["engine_max_pages"], stats["engine_max_seqs"], stats["engine_max_prefill_size"]) == (96, 32, 4096)
    assert stats["num_preemptions"] == 0
    assert "engine sized for this machine: max_pages=96, max_seqs=32, max_prefill_size=4,096" in capsys.readouterr().err
    assert generate_main([*args, "--engine.max_seqs", "8"]) == 0
    stats = json.loads(stats_file.read_text())
    assert (stats["engine_max_pages"], stats["engine_max_seqs"], stats["engine_max_prefill_size"]) == (24, 8, 4096)


def test_generate_with_no_engine_flags_sizes_its_context_to_the_input(tmp_path, model_dir, capsys):
    """tiny-llama's context is 2,048 tokens (128 pages); three 3-token prompts with 4 new tokens need 1 page each,
    and three sequences take 4 slots (the power of two that holds them, not the CPU's 128), which use 4 pages:
    max_seq_len follows the input (7 tokens), or the pool would not hold one sequence of the model's whole
    context."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": [5 + i, 6, 7]}) + "\n"
                                               for i in range(3)))
    stats_file = tmp_path / "stats.json"
    assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "out.jsonl"), "--stats_output", str(stats_file), "--progress=false",
                          "--sampling.max_new_tokens=4"]) == 0
    stats = json.loads(stats_file.read_text())
    assert (stats["engine_max_seq_len"], stats["engine_max_seqs"], stats["engine_max_pages"]) == (7, 4, 4)
    assert "engine sized for this machine: max_seq_len=7, max_pages=4, max_seqs=4" in capsys.readouterr().err
    assert all(len(json.loads(line)["token_ids"]) == 4 for line in (tmp_path / "out.jsonl").read_text().splitlines())


def test_generate_judges_bad_lines_as_a_run_judges_corpus_rows(tmp_path, model_dir):
    """Each bad line becomes a record naming the reason `pagefleet run` writes to rejected.jsonl; nothing is
    repaired (a line that is not UTF-8 is not decoded with replacement characters) and the good lines run. A line
    no run could use (a lone surrogate, max_new_tokens past int32, a temperature that is not a finite number) is
    one such record too, not the end of the call."""
    lines = [b'{"id": "ok", "prompt": "Hello there"}',
             b'{"id": "bytes", "prompt": "caf\xe9"}',  # Latin-1, not UTF-8: not even its id is read
             b'{"id": "blank", "prompt": "   "}',
             b'[1, 2, 3]',
             b'{"id": {"x": 1}, "prompt": "an id that is an object"}',
             b'{"id": "num", "prompt": 17}',
             b'{"id": "both", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
             b'{"id": "nochat", "messages": []}',
             b'{"id": "nofield", "text": "hi"}',
             b'{"id": "bools", "prompt_token_ids": [true, false]}',
             b'{"id": 7, "prompt_token_ids": [5, 6, 7], "prompt": "token ids win"}',
             b'{"id": "lone", "prompt": "a\\ud800b"}',
             b'{"id": "huge", "prompt": "hi", "sampling": {"max_new_tokens": 2147483648}}',
             b'{"id": "nan", "prompt": "hi", "sampling": {"temperature": NaN}}',
             b'{"id": "inf", "prompt": "hi", "sampling": {"temperature": Infinity}}']
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    code = generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                          "--sampling.max_new_tokens=3", "--engine.max_seq_len=128", "--engine.max_pages=16",
                          "--progress=false"])
    assert code == 0
    by = {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(by) == ["ok", "line-2", "blank", "line-4", "line-5", "num", "both", "nochat", "nofield", "bools", 7,
                        "line-12", "huge", "nan", "inf"]
    expected = {"line-2": "undecodable: line 2 is not UTF-8 (invalid continuation byte at byte 30)",
                "blank": "empty_prompt: field 'prompt' is empty",
                "line-4": "malformed_row: line 4 is a JSON list, not an object",
                "line-5": "wrong_type: field 'id' is a dict, not a string or integer",
                "num": "wrong_type: field 'prompt' is an int, not a string",
                "both": "malformed_row: row has both 'prompt' and 'messages'",
                "nochat": "empty_prompt: field 'messages' is an empty list",
                "nofield": "missing_field: row has no 'prompt', 'messages' or 'prompt_token_ids' field",
                "bools": "wrong_type: prompt_token_ids must be a list of integers",
                "nan": "bad_sampling: field 'sampling': sampling.temperature must be a finite number, got nan",
                "inf": "bad_sampling: field 'sampling': sampling.temperature must be a finite number, got inf"}
    assert {pid: r.get("error") for pid, r in by.items() if pid in expected} == expected
    assert by["line-12"]["error"].startswith("undecodable: line 12: row holds a lone surrogate (\\ud800)")
    assert by["huge"]["error"].startswith("bad_sampling: field 'sampling': sampling.max_new_tokens must be at most")
    for pid in expected:
        assert by[pid]["token_ids"] == [] and by[pid]["finish_reason"] is None
    for pid in ("ok", 7):
        assert "error" not in by[pid] and len(by[pid]["token_ids"]) >= 1
    assert by[7]["num_prompt_tokens"] == 3


def test_generate_refuses_unknown_keys_and_tiny_capacity(tmp_path, model_dir):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "o.jsonl")]
    proc = run_cli(*args, "--sampling.max_new_tokenz=3")
    assert proc.returncode != 0 and "max_new_tokenz" in proc.stderr
    proc = run_cli(*args, "--engine.max_pages=2")
    assert proc.returncode != 0 and "engine.max_pages=2" in proc.stderr
    for flags, names in ((["--engine.preemption=swap", "--engine.host_kv_pages=1000000000000"],
                          "engine.host_kv_pages=1,000,000,000,000 takes"),
                         (["--engine.max_pages=100000000000"], "engine.max_pages=100,000,000,000 takes")):
        proc = run_cli(*args, *flags)  # pools larger than the memory: one line naming the key, not a MemoryError
        err = proc.stderr.strip()
        assert proc.returncode != 0 and names in err and "internal error" not in err and "\n" not in err, err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("preset, seed", [("tiny-llama", 0), ("tiny-mistral", 3), ("tiny-qwen2", 0)])
def test_greedy_equals_transformers_with_admission_and_preemption(tmp_path, preset, seed):
    """64 prompts of 1 to 400 tokens through `pagefleet generate` (prompt_token_ids lines): the same greedy
    tokens as transformers' `generate`, with 8 slots (continuous admission: every slot filled, asserted) and
    70 pages of 16 tokens, fewer than the long prompts need together (preemption: asserted)."""
    new_tokens = 16
    model = write_model(preset, tmp_path / "model", seed=seed)
    prompts = varied_prompts(json.loads((model / "config.json").read_text())["vocab_size"])
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n"
                                               for i, p in enumerate(prompts)))
    out, stats_file = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code = generate_main(["--model", str(model), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                          "--stats_output", str(stats_file), "--progress=false",
                          f"--sampling.max_new_tokens={new_tokens}", "--sampling.temperature=0", "--engine.page_size=16",
                          "--engine.max_pages=70", "--engine.max_seqs=8", "--engine.max_seqs_in_prefill=4",
                          "--engine.max_prefill_size=256", "--engine.max_seq_len=512", "--engine.debug_invariants=true"])
    assert code == 0
    stats = json.loads(stats_file.read_text())
    assert stats["num_preemptions"] > 0, "the test must exercise preemption"
    assert stats["max_slot_occupancy"] == 1.0 and stats["wall_s"] >= stats["device_s"] > 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == [f"p{i}" for i in range(len(prompts))]
    eos = transformers.AutoConfig.from_pretrained(model).eos_token_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for i, (p, r) in enumerate(zip(prompts, records)):
        ref, gap = hf_greedy(hf, p, new_tokens)
        n = len(r["token_ids"])
        assert gap > MIN_GAP, f"{preset} prompt {i}: top-2 gap {gap} too small for the comparison to mean anything"
        assert r["token_ids"] == ref[:n], f"{preset} prompt {i} (len {len(p)})"
        assert r["num_prompt_tokens"] == len(p) and "error" not in r
        if r["finish_reason"] == "length":
            assert n == new_tokens
        else:
            assert r["finish_reason"] == "stop" and r["token_ids"][-1] in ([eos] if isinstance(eos, int) else eos)


def test_generate_exits_fault_when_every_sample_failed_and_says_too_long(tmp_path, model_dir, capsys):
    """`--engine.max_seqs=4` alone is a working engine (max_seqs_in_prefill follows it); a run whose every line
    fails writes its error records and exits FAULT; a prompt too long starts its error with `too_long:`."""
    from orchestrator import exit_codes

    lines = ['{"id": "long", "prompt_token_ids": ' + json.dumps([5] * 200) + '}', '{"id": "e", "prompt": ""}', "{"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    code = generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                          "--engine.max_seqs=4", "--engine.max_seq_len=128", "--engine.max_pages=16",
                          "--sampling.max_new_tokens=8", "--progress=false"])
    assert code == exit_codes.FAULT
    errors = {r["prompt_id"]: r["error"] for r in map(json.loads, out.read_text().splitlines())}
    assert errors["long"].startswith("too_long: prompt has 200 tokens")
    assert errors["e"].startswith("empty_prompt:") and errors["line-3"].startswith("malformed_row:")
    assert "every one of the 3 samples failed" in capsys.readouterr().err


def test_generate_help_lists_each_key_once_and_bad_arguments_are_one_line(capsys):
    from orchestrator.commands.cli import main

    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("--sampling.max_new_tokens", "--engine.max_seqs", "--model", "--stats_output"):
        assert out.count(f"  {key} ") == 1, key
    assert "--sampling " not in out and "--engine " not in out  # no section-level "config file" flags
    assert main(["generate", "--model", "m", "--sampling.max_new_tokens"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagefleet generate: argument --sampling.max_new_tokens: expected one argument")
    assert len(err.strip().splitlines()) == 1


def test_generate_names_a_hub_id_that_is_not_cached(tmp_path, monkeypatch, capsys):
    from orchestrator.commands.cli import main

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    assert main(["generate", "--model", "org/absent", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagefleet generate: --model 'org/absent' is not a local directory, and the Hub id")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o.jsonl").exists()


def test_generate_passes_input_columns_through_and_keeps_integer_ids(tmp_path, model_dir):
    """Item 10: a sample carries its prompt and the input's other columns, an integer id comes back an integer
    (a string id a string), and a column named like a record field is an error naming it, not a silent loss."""
    rows = [{"id": 7, "prompt": "Hello there", "meta": {"source": "web", "tags": [1, 2]}},
            {"id": "s", "prompt_token_ids": [5, 6, 7], "lang": "en"},
            {"id": 9, "prompt": "the sea", "completion": "a reference answer"},
            {"prompt": "no id", "meta": None}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                          "--sampling.max_new_tokens=3", "--engine.max_seq_len=128", "--engine.max_pages=32",
                          "--progress=false"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == [7, "s", 9, "line-4"]
    assert records[0]["prompt"] == "Hello there" and records[0]["meta"] == {"source": "web", "tags": [1, 2]}
    assert list(records[0])[:13] == ["prompt_id", "generation_index", "completion", "token_ids", "logprobs",
                                     "finish_reason", "num_prompt_tokens", "batch_id", "continuation_logprobs",
                                     "continuation_logprob", "is_greedy", "prompt_logprobs", "prompt"]
    assert "passthrough" not in records[0]
    assert records[1]["prompt_token_ids"] == [5, 6, 7] and records[1]["lang"] == "en"
    assert records[2]["error"].startswith("reserved_column: column 'completion' has the name of a sample record field")
    assert records[2]["completion"] == "" and records[2]["token_ids"] == []
    assert records[3]["prompt"] == "no id" and records[3]["meta"] is None and "error" not in records[3]
    # Seeding still reads the id as a string: an integer id samples what the same id as a string samples.
    (tmp_path / "str.jsonl").write_text(json.dumps({"id": "7", "prompt": "Hello there"}) + "\n")
    sampled = {}
    for name in ("in", "str"):
        assert generate_main(["--model", str(model_dir), "--input", str(tmp_path / f"{name}.jsonl"), "--output",
                              str(tmp_path / f"{name}.out"), "--sampling.max_new_tokens=4",
                              "--sampling.temperature=0.9", "--sampling.seed=5", "--engine.max_seq_len=128",
                              "--engine.max_pages=32", "--progress=false"]) in (0, 2)
        sampled[name] = json.loads((tmp_path / f"{name}.out").read_text().splitlines()[0])["token_ids"]
    assert sampled["in"] == sampled["str"]


@pytest.mark.slow  # two generate processes (one reading the model from the Cloud Storage emulator): ~30 s
def test_generate_reads_a_gs_model_and_samples_exactly_as_from_the_local_copy(tmp_path, model_dir, gcs_bucket):
    from tests.gcs_emulator import upload

    url = upload(str(model_dir), f"{gcs_bucket}/models/tiny")
    rows = ['{"id": "a", "prompt": "Hello there"}', '{"id": "b", "messages": [{"role": "user", "content": "hi"}]}',
            '{"id": "c", "prompt_token_ids": [5, 6, 7]}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    outs = {}
    for where, model in [("local", str(model_dir)), ("gs", url)]:
        outs[where] = tmp_path / f"{where}.jsonl"
        proc = run_cli("generate", "--model", model, "--input", str(tmp_path / "in.jsonl"), "--output",
                       str(outs[where]), "--sampling.max_new_tokens=6", "--sampling.n=2", "--sampling.temperature=0.7",
                       "--sampling.logprobs=true", "--engine.max_seq_len=256", "--engine.max_pages=32",
                       "--progress=false")
        assert proc.returncode == 0, proc.stderr
    assert f"model read from {url} in " in proc.stderr and "bytes, ranged reads" in proc.stderr
    local, remote = outs["local"].read_text(), outs["gs"].read_text()
    assert local == remote and '"error"' not in local
