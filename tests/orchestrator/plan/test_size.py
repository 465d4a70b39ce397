import json
import math
from pathlib import Path

import pytest

from engine.models.model_config import ModelConfig
from orchestrator.commands.cli import main
from orchestrator.plan.size import CHIPS, GiB, SizingError, count_params, kv_bytes_per_token, read_model_config, size
from tests.orchestrator.plan.llama31_8b import LLAMA_31_8B_CONFIG, write_llama31_8b_config

ROOT = Path(__file__).resolve().parents[3]
LLAMA = ModelConfig.from_hf(LLAMA_31_8B_CONFIG)


def test_llama31_8b_parameters_and_kv_bytes():
    params = count_params(LLAMA)
    assert params.total == 8_030_261_248  # the released checkpoint's parameter count
    embed = 128256 * 4096
    assert params.replicated == 2 * embed + 32 * 2 * 4096 + 4096  # embeddings, untied lm_head, norms
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336  # q, o, k, v, gate/up/down
    assert params.sharded == 32 * per_layer
    assert kv_bytes_per_token(LLAMA, 2) == 131072 == 128 * 1024
    assert kv_bytes_per_token(LLAMA, 4) == 2 * 131072


def test_the_shipped_config_json_is_llama31_8b():
    cfg, name = read_model_config(ROOT / "configs" / "models" / "llama-3.1-8b")
    assert cfg == LLAMA and name == "llama-3.1-8b"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_pages_are_what_hbm_leaves_after_weights_and_reserve(tp):
    r = size(LLAMA, hbm_gib=95, hbm_gb_per_s=2765, tp=tp, chips_per_slice=8, prompt_tokens=2048, new_tokens=1024,
             page_size=16, reserve_fraction=0.15)
    hbm = 95 * 2**30
    reserve = int(hbm * 0.15)
    weights = (1_050_939_392 + 6_979_321_856 // tp) * 2
    page_bytes_per_chip = 16 * 131072 // tp
    assert r.weight_bytes_per_chip == weights
    assert r.kv_bytes_per_token_per_chip == 131072 // tp
    assert r.max_pages == (hbm - reserve - weights) // page_bytes_per_chip
    assert r.max_pages * page_bytes_per_chip <= hbm - reserve - weights < (r.max_pages + 1) * page_bytes_per_chip
    assert r.pages_per_seq == 192 and r.seqs_that_fit == r.max_pages // 192
    assert r.max_seqs == min(256, 2 ** int(math.log2(r.seqs_that_fit)))
    assert r.engines_per_slice == 8 // tp
    assert r.max_seqs_in_prefill <= r.max_seqs and r.max_prefill_size == 2048 and r.max_seq_len == 3072


def test_decode_bound_reads_weights_and_live_kv_once_per_step():
    r = size(LLAMA, hbm_gib=95, hbm_gb_per_s=2765, tp=4, chips_per_slice=8, prompt_tokens=1000, new_tokens=200)
    step_bytes = r.weight_bytes_per_chip + r.max_seqs * (1000 + 100) * 32768
    assert r.decode_step_s == pytest.approx(step_bytes / 2765e9)
    assert r.decode_tokens_per_s_per_engine == pytest.approx(r.max_seqs / r.decode_step_s)
    assert r.decode_tokens_per_s_per_slice == pytest.approx(2 * r.decode_tokens_per_s_per_engine)


def test_few_pages_give_a_power_of_two_below_what_fits():
    # 16 GiB at tp 1: 14.96 GiB of weights leave about 0.6 GiB after a 2% reserve.
    r = size(LLAMA, hbm_gib=16, hbm_gb_per_s=819, tp=1, prompt_tokens=1024, new_tokens=1024, reserve_fraction=0.02)
    assert 0 < r.seqs_that_fit < 256
    assert r.max_seqs <= r.seqs_that_fit < 2 * r.max_seqs


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 3}, "8 KV heads.*--tp"),
    ({"tp": 64}, "8 KV heads and 32 attention heads cannot be split over 64 devices.*--tp"),
    ({"tp": 4, "chips_per_slice": 6}, "multiple of --tp"),
    ({"hbm_gib": 16, "tp": 1}, "weights take .* raise --tp"),
    ({"prompt_tokens": 131072}, "context of 131072"),
    ({"dtype": "int8"}, "--dtype"),
    ({"reserve_fraction": 1.5}, "--reserve-fraction"),
])
def test_errors_name_the_fix(kwargs, message):
    args = {"hbm_gib": 95, "hbm_gb_per_s": 2765, "prompt_tokens": 1024, "new_tokens": 256, **kwargs}
    with pytest.raises(SizingError, match=message):
        size(LLAMA, **args)


def test_tp_beyond_the_kv_heads_counts_the_replicated_kv():
    """At tp 16 each of the 8 KV heads is held by 2 chips: a chip holds as much KV (one head) as at tp 8, and the
    K and V projections of its copy on top of its sixteenth of the rest."""
    args = {"hbm_gib": 95, "hbm_gb_per_s": 2765, "prompt_tokens": 1024, "new_tokens": 256}
    tp8, tp16 = size(LLAMA, tp=8, **args), size(LLAMA, tp=16, **args)
    assert tp16.kv_bytes_per_token_per_chip == tp8.kv_bytes_per_token_per_chip == 2 * 32 * 128 * 2
    assert tp16.kv_bytes_per_token == 2 * tp8.kv_bytes_per_token  # the replicated pool, over all 16 chips
    kv_projections = 32 * 2 * 4096 * 128 * 2  # one KV head's K and V in every layer, bf16
    assert tp16.weight_bytes_per_chip - tp8.weight_bytes_per_chip // 2 == pytest.approx(
        kv_projections / 2 + count_params(LLAMA).replicated * 2 / 2, rel=1e-9)
    assert tp16.num_params == tp8.num_params  # the checkpoint's own count


def test_chip_table_holds_the_documented_figures():
    assert (CHIPS["v5p"].hbm_gib, CHIPS["v5p"].hbm_gb_per_s) == (95, 2765)
    assert (CHIPS["v6e"].hbm_gib * GiB, CHIPS["v6e"].hbm_gb_per_s) == (pytest.approx(32e9), 1638)
    assert (CHIPS["v5e"].hbm_gib * GiB, CHIPS["v5e"].hbm_gb_per_s) == (pytest.approx(16e9), 819)
    assert (CHIPS["v4"].hbm_gib, CHIPS["v4"].hbm_gb_per_s) == (32, 1200)


def test_cli_prints_text_and_json(tmp_path, capsys):
    model = write_llama31_8b_config(tmp_path / "llama")
    args = ["size", "--model", str(model), "--chip", "v5p", "--chips", "8", "--tp", "4",
            "--prompt-tokens", "2048", "--new-tokens", "1024"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out and "131,072 bytes (128 KiB)" in out and "engine.max_pages:" in out
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = size(LLAMA, hbm_gib=95, hbm_gb_per_s=2765, tp=4, chips_per_slice=8, prompt_tokens=2048, new_tokens=1024)
    assert report["max_pages"] == expected.max_pages and report["kv_bytes_per_token"] == 131072
    # The config.json file itself works as --model too, and flags override the chip's figures.
    assert main(args[:2] + [str(model / "config.json")] + args[3:] + ["--hbm-gib", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hbm_bytes_per_chip"] == 64 * GiB


def test_cli_errors_name_the_fix(tmp_path, capsys):
    assert main(["size", "--model", str(tmp_path), "--chip", "v5p", "--prompt-tokens", "8", "--new-tokens", "8"]) == 2
    assert "config.json" in capsys.readouterr().err
    model = write_llama31_8b_config(tmp_path / "llama")
    assert main(["size", "--model", str(model), "--prompt-tokens", "8", "--new-tokens", "8"]) == 2
    assert "--chip" in capsys.readouterr().err
    assert main(["size", "--model", str(model), "--chip", "v5p", "--tp", "3", "--prompt-tokens", "8",
                 "--new-tokens", "8"]) == 2
    assert "KV heads" in capsys.readouterr().err


def _size_command(yaml_path: Path) -> list[str] | None:
    """The `pagefleet size ...` command quoted in a config's comments (continuation lines joined)."""
    lines = [line.lstrip("# ").rstrip() for line in yaml_path.read_text().splitlines() if line.startswith("#")]
    text = " ".join(lines).replace("\\ ", " ")
    if "pagefleet size " not in text:
        return None
    command = text.split("pagefleet size ", 1)[1].split(" (", 1)[0]
    return command.split()


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "configs").glob("**/*.yaml")) if _size_command(p)],
                         ids=lambda p: p.name)
def test_configs_hold_what_their_size_command_prints(path, capsys, monkeypatch):
    from orchestrator.config import load_run_config

    monkeypatch.chdir(ROOT)
    assert main(["size", *_size_command(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cfg = load_run_config(path)
    for key in ("max_pages", "max_seqs", "max_seqs_in_prefill", "max_prefill_size", "max_seq_len"):
        assert getattr(cfg.engine, key) == report[key], key
    assert (cfg.engine.page_size, cfg.cluster.mesh["model"], cfg.model.dtype) == \
        (report["page_size"], report["tp"], report["dtype"])
    assert cfg.sampling.max_new_tokens == report["new_tokens"]
    assert cfg.cluster.hosts_per_slice * cfg.cluster.devices_per_host == report["chips_per_slice"]


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "configs").glob("**/*.yaml")) if _size_command(p)],
                         ids=lambda p: p.name)
def test_configs_use_the_split_their_size_command_marks_best(path, capsys, monkeypatch):
    """The same command without --tp lists every split of the slice; the config's mesh is the one marked best."""
    from orchestrator.config import load_run_config

    monkeypatch.chdir(ROOT)
    command = _size_command(path)
    without_tp = [a for i, a in enumerate(command) if a != "--tp" and (i == 0 or command[i - 1] != "--tp")]
    assert main(["size", *without_tp, "--json"]) == 0
    (best,) = [r for r in json.loads(capsys.readouterr().out) if r["best"]]
    mesh = load_run_config(path).cluster.mesh
    assert (mesh.get("data", 1), mesh["model"]) == (best["data"], best["model"])


def split_rows(chip: str, chips: int) -> list:
    from orchestrator.plan.size_split import split_table

    c = CHIPS[chip]
    return split_table(LLAMA, chips=chips, chips_per_host=c.chips_per_host(chips), hbm_gib=c.hbm_gib,
                       hbm_gb_per_s=c.hbm_gb_per_s, prompt_tokens=2048, new_tokens=1024)


def test_split_tables_for_llama31_8b():
    """Every (data, model) with model in the widths 8 KV heads allow (1, 2, 4, 8; 16 and 32 would need more chips),
    each sized as `size` sizes one engine; the best is the highest decode bound among the splits that run."""
    v5p, v6e, h100 = split_rows("v5p", 8), split_rows("v6e", 8), split_rows("h100", 8)
    for rows in (v5p, v6e, h100):
        assert [(r.data, r.model) for r in rows] == [(8, 1), (4, 2), (2, 4), (1, 8)]
        for r in rows:
            expected = size(LLAMA, hbm_gib=rows[0].report.hbm_bytes_per_chip / GiB,
                            hbm_gb_per_s=r.report.hbm_gb_per_s, tp=r.model, chips_per_slice=8,
                            prompt_tokens=2048, new_tokens=1024)
            assert r.report.max_pages == expected.max_pages and r.report.max_seqs == expected.max_seqs
    # v5p-16: 2 hosts of 4 chips; every split runs (engines of up to 4 chips each on one host, host-level data
    # parallelism; {1, 8}: one engine over both hosts). Four engines of two chips bound highest.
    assert all(r.why_not is None for r in v5p) and [(r.data, r.model) for r in v5p if r.best] == [(4, 2)]
    assert [round(r.report.decode_tokens_per_s_per_slice) for r in v5p] == [47981, 54417, 52304, 48535]
    # 16 v5p chips in 4 hosts: 2 engines of 8 chips would each span 2 hosts, which does not run.
    v5p32 = split_rows("v5p", 16)
    assert [(r.data, r.model, r.why_not is None) for r in v5p32][-2:] == [(2, 8, False), (1, 16, True)]
    # v6e-8, one host: every split runs; one engine over the 8 chips bounds highest.
    assert all(r.why_not is None for r in v6e) and [(r.data, r.model) for r in v6e if r.best] == [(1, 8)]
    assert [round(r.report.decode_tokens_per_s_per_slice) for r in v6e] == [9784, 21158, 25680, 28752]
    # 8 x H100 (one node): 80 GB each; four engines of two GPUs bound highest.
    assert [(r.data, r.model) for r in h100 if r.best] == [(4, 2)]
    assert h100[0].report.hbm_bytes_per_chip == pytest.approx(80e9, abs=1) and h100[0].report.hbm_gb_per_s == 3350


def test_split_table_cli_and_its_errors(tmp_path, capsys):
    model = write_llama31_8b_config(tmp_path / "llama")
    args = ["size", "--model", str(model), "--chip", "h200", "--chips", "8", "--prompt-tokens", "2048",
            "--new-tokens", "1024"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "splits of 8 h200 chips (8 a host)" in out and out.count("{data: ") == 5  # 4 rows and the best line
    assert "* best: cluster.mesh {data: " in out
    assert main(args + ["--chips-per-host", "3"]) == 2
    assert "--chips-per-host 3" in capsys.readouterr().err
    mqa = ModelConfig.from_hf({**json.loads((model / "config.json").read_text()), "num_key_value_heads": 1})
    from orchestrator.plan.size_split import split_table

    rows = split_table(mqa, chips=8, chips_per_host=8, hbm_gib=95, hbm_gb_per_s=2765, prompt_tokens=2048,
                       new_tokens=1024)
    assert [r.model for r in rows] == [1, 2, 4, 8]  # one KV head: replicated at 2, 4 and 8
    assert rows[-1].report.kv_bytes_per_token_per_chip == rows[0].report.kv_bytes_per_token_per_chip
