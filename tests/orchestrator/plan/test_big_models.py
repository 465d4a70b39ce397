"""The shipped big configs (configs/models/: Qwen3-8B, Qwen3-32B, Llama-3.3-70B) through `pagefleet size` and
`pagefleet check` on v5p and v6e slices of 8 chips, with the numbers docs/sizing.md quotes. The shipped run configs
(configs/*.yaml) are checked against their own size commands by test_size.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.model_config import ModelConfig
from engine.sizing.model_bytes import count_params
from orchestrator.commands.check import main as check_main
from orchestrator.commands.cli import main
from orchestrator.exit_codes import OK

ROOT = Path(__file__).resolve().parents[3]
WORKLOAD = ["--chips", "8", "--prompt-tokens", "2048", "--new-tokens", "1024"]

# model, chip -> (parameters, weights GiB per chip, the best split's (data, model), its max_pages and max_seqs)
SIZES = {
    ("qwen3-8b", "v5p"): (8_190_735_360, 8.79, (4, 2), 65_501, 256),
    ("qwen3-8b", "v6e"): (8_190_735_360, 3.94, (1, 8), 77_899, 256),
    ("qwen3-32b", "v5p"): (32_762_123_264, 17.43, (2, 4), 64_839, 256),
    ("qwen3-32b", "v6e"): (32_762_123_264, 10.16, (1, 8), 31_062, 128),
    ("llama-3.3-70b", "v5p"): (70_553_706_496, 19.85, (1, 8), 99_771, 256),
    ("llama-3.3-70b", "v6e"): (70_553_706_496, 19.85, (1, 8), 8_975, 32),
}


@pytest.mark.parametrize("model, chip", list(SIZES))
def test_size_picks_a_split_that_fits_and_counts_the_published_parameters(model, chip, capsys, monkeypatch):
    params, weights_gib, split, pages, seqs = SIZES[model, chip]
    monkeypatch.chdir(ROOT)
    assert main(["size", "--model", f"configs/models/{model}", "--chip", chip, *WORKLOAD, "--json"]) == 0
    (best,) = [r for r in json.loads(capsys.readouterr().out) if r["best"]]
    assert (best["data"], best["model"]) == split
    assert main(["size", "--model", f"configs/models/{model}", "--chip", chip, *WORKLOAD, "--tp", str(split[1]),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_params"] == params
    assert round(report["weight_bytes_per_chip"] / 2**30, 2) == weights_gib
    assert (report["max_pages"], report["max_seqs"]) == (pages, seqs)


# The slices of SIZES as `check` overrides of a shipped config: its cluster and the best split's pool; one small
# shape bucket each (4 decode rows, 16-token prefill steps, single-step decode) so the default suite stays fast.
SLICES = {"v5p": ["--cluster.hosts_per_slice=2", "--cluster.devices_per_host=4", "--cluster.resources_per_host={TPU: 4}",
                  "--cluster.slice_head_resource=TPU-v5p-16-head"],
          "v6e": ["--cluster.hosts_per_slice=1", "--cluster.devices_per_host=8", "--cluster.resources_per_host={TPU: 8}",
                  "--cluster.slice_head_resource=TPU-v6e-8-head"]}
SMALL_BUCKETS = ["--engine.max_seqs=4", "--engine.max_seqs_in_prefill=2", "--engine.max_prefill_size=16",
                 "--engine.decode_steps=1"]


# Two in the default suite (the largest model on v5p, the smallest on v6e); the rest take 10-20 s each.
FAST_CHECKS = {("llama-3.3-70b", "v5p"), ("qwen3-8b", "v6e")}


@pytest.mark.parametrize("model, chip", [pytest.param(m, c, marks=() if (m, c) in FAST_CHECKS else pytest.mark.slow)
                                         for m, c in SIZES])
def test_check_lowers_each_big_model_for_its_slice_and_fits(model, chip, capsys):
    _, _, (data, width), pages, _ = SIZES[model, chip]
    args = [str(ROOT / "configs/qwen3-8b-v6e-8.yaml"), f"--model.path={ROOT / 'configs/models' / model}",
            "--target", f"tpu-{chip}", *SLICES[chip], f"--cluster.mesh={{data: {data}, model: {width}}}",
            f"--engine.max_pages={pages}", *SMALL_BUCKETS]
    assert check_main(args) == OK
    out = capsys.readouterr().out
    assert "step programs: 2 lowered for tpu" in out and f"({pages:,} pages of 16 tokens)" in out
    assert out.rstrip().endswith("ok: the config passes the head's checks, compiles for the target and fits")


@pytest.mark.slow
@pytest.mark.parametrize("config, model", [("qwen3-30b-a3b-v5p-16.yaml", "qwen3-30b-a3b"),
                                           ("mixtral-8x7b-v5p-16.yaml", "mixtral-8x7b")])
def test_the_shipped_moe_configs_lower_for_their_targets(config, model, capsys):
    """A minute or two each: every layer unrolled with its grouped matmul (ragged_dot), one small shape bucket."""
    assert check_main([str(ROOT / "configs" / config), f"--model.path={ROOT / 'configs/models' / model}",
                       *SMALL_BUCKETS]) == OK
    out = capsys.readouterr().out
    assert "step programs: 2 lowered for tpu" in out and "of 95.00 GiB" in out


def test_moe_parameters_count_every_expert():
    """Qwen3-30B-A3B: 30.5B parameters (3.3B active); Mixtral-8x7B: 46.7B (12.9B active)."""
    qwen = count_params(ModelConfig.from_pretrained(ROOT / "configs/models/qwen3-30b-a3b"))
    mixtral = count_params(ModelConfig.from_pretrained(ROOT / "configs/models/mixtral-8x7b"))
    assert (qwen.total, mixtral.total) == (30_532_122_624, 46_702_792_704)
    assert qwen.replicated == 151936 * 2048 * 2 + 48 * (2 * 2048 + 2 * 128 + 128 * 2048) + 2048


@pytest.mark.slow
@pytest.mark.parametrize("config, model, hbm", [("qwen3-8b-v6e-8.yaml", "qwen3-8b", "of 29.80 GiB"),
                                                ("qwen3-32b-v5p-16.yaml", "qwen3-32b", "of 95.00 GiB"),
                                                ("llama3.3-70b-v5p-16.yaml", "llama-3.3-70b", "of 95.00 GiB")])
def test_the_shipped_big_configs_pass_for_their_targets(config, model, hbm, capsys):
    """A few minutes each: every shape bucket of the shipped capacities lowered for the slice's TPU."""
    assert check_main([str(ROOT / "configs" / config), f"--model.path={ROOT / 'configs/models' / model}"]) == OK
    out = capsys.readouterr().out
    assert "step programs: 20 lowered for tpu" in out and hbm in out and "Pallas kernel VMEM" in out
