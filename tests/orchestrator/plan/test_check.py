"""`pagefleet check`: the head's validation, the step programs lowered for TPU, VMEM and HBM against the chip."""

import json
from pathlib import Path

import pytest

from orchestrator.commands.check import main
from orchestrator.plan.check import default_target
from orchestrator.commands.cli import main as cli_main
from orchestrator.exit_codes import FAULT, OK

REPO = Path(__file__).resolve().parents[3]

# A small Llama with heads of 128 (the Pallas kernel's lane width); config.json is all the check reads.
SMALL_MODEL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=512,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=512,
                   max_position_embeddings=65536, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=2)
# One shape bucket each: T=16 with prompt chunks, S=4 decode rows; multi-step decode off.
SMALL_ENGINE = ["--engine.max_seqs=4", "--engine.max_seqs_in_prefill=2", "--engine.max_prefill_size=16",
                "--engine.decode_steps=1", "--engine.max_seq_len=256", "--engine.max_pages=64"]


@pytest.fixture
def small_config(tmp_path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_MODEL))
    config = tmp_path / "run.yaml"
    config.write_text(f"name: small\nmodel:\n  path: {model}\n  dtype: bfloat16\n"
                      "cluster:\n  hosts_per_slice: 1\n  devices_per_host: 2\n  mesh: {model: 2}\n")
    return str(config)


def test_a_config_that_compiles_and_fits_passes(small_config, capsys):
    assert main([small_config, "--target", "tpu-v5e", *SMALL_ENGINE]) == OK
    out = capsys.readouterr().out
    assert "head validation: ok" in out
    assert "mesh: 2 devices, data 1 x model 2, JAX device kind 'TPU v5 lite'" in out
    assert "step programs: 2 lowered for tpu" in out
    assert "Pallas kernel VMEM: at most" in out and "of 128 MiB per TensorCore" in out
    # 64 pages x 16 tokens x (2 layers x 2 x 2 KV heads x 128 x 2 bytes) / 2 chips = 1 MiB
    assert "KV pool 0.00 GiB (64 pages of 16 tokens)" in out and "of 14.90 GiB" in out
    assert out.rstrip().endswith("ok: the config passes the head's checks, compiles for the target and fits")


def test_a_pool_larger_than_hbm_is_refused_with_the_numbers(small_config, capsys):
    # 20M pages x 16 tokens x 2,048 bytes per token / 2 chips = 305 GiB per chip, on a 16 GB v5e.
    code = main([small_config, "--target", "tpu-v5e", *SMALL_ENGINE, "--engine.max_pages=20000000"])
    err = capsys.readouterr().err
    assert code == FAULT
    assert "KV pool 305.18 GiB (20,000,000 pages of 16 tokens)" in err
    assert "exceeds the v5e's 14.90 GiB of HBM; lower engine.max_pages" in err


def test_kernel_blocks_larger_than_vmem_are_refused_with_the_numbers(small_config, capsys):
    # Pages of 256 tokens, 128 of them per sequence: the kernel's double-buffered KV block alone is
    # 2 x 128 pages x 256 tokens x 4 (K, V of 2 heads) x 128 x 2 bytes = 64 MiB, a v5p core's whole VMEM.
    # (128 pages: the pool must hold one whole sequence, which the head checks first.)
    code = main([small_config, "--target", "tpu-v5p", *SMALL_ENGINE, "--engine.page_size=256",
                 "--engine.max_seq_len=32768", "--engine.max_pages=128", "--cluster.mesh={model: 1}"])
    err = capsys.readouterr().err
    assert code == FAULT
    assert "128 pages of 256 tokens x 16 queries per block" in err
    assert "MiB of VMEM, the v5p has 64 MiB per TensorCore; lower engine.page_size" in err


def test_a_multihost_slice_without_tensor_parallelism_lowers(small_config, capsys):
    """Two hosts, `model: 1`: the mesh spans both hosts' devices with the model replicated; the Pallas kernel
    must still be called per device (Mosaic kernels are not partitioned automatically)."""
    assert main([small_config, "--target", "tpu-v5e", *SMALL_ENGINE, "--cluster.hosts_per_slice=2",
                 "--cluster.mesh={model: 1}"]) == OK
    assert "mesh: 4 devices, data 4 x model 1" in capsys.readouterr().out


def test_a_data_parallel_slice_lowers_one_engines_mesh(small_config, capsys):
    """Two hosts of 2 chips, {data: 4, model: 1}: each host runs 2 engines of 1 chip; the check lowers that engine."""
    assert main([small_config, "--target", "tpu-v5e", *SMALL_ENGINE, "--cluster.hosts_per_slice=2",
                 "--cluster.mesh={data: 4, model: 1}"]) == OK
    assert "mesh: 1 devices, data 1 x model 1 (each of the slice's 4 engines)" in capsys.readouterr().out


def test_the_head_rejects_before_lowering(small_config, capsys):
    """The head's own cluster check, through the `pagefleet` command line."""
    assert cli_main(["check", small_config, "--cluster.mesh={model: 3}"]) == FAULT
    err = capsys.readouterr().err
    assert "the head rejects the config: cluster.mesh.model=3 does not divide the slice's 2 devices" in err


def test_the_target_defaults_to_the_slice_head_resource():
    assert default_target("TPU-v5p-16-head") == "tpu-v5p"
    assert default_target("TPU-v6e-8-head") == "tpu-v6e"
    assert default_target(None) == "cpu" and default_target("TPU-v2-8-head") == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("config, programs, hbm", [
    ("llama3.1-8b-v5p-16.yaml", 20, "of 95.00 GiB"),
    ("llama3.1-8b-v6e-8.yaml", 20, "of 29.80 GiB"),
])
def test_the_shipped_llama_configs_pass_for_their_targets(config, programs, hbm, capsys):
    """About a minute each: 20 programs of a 32-layer model lowered for the slice's TPU."""
    assert main([str(REPO / "configs" / config), f"--model.path={REPO / 'configs/models/llama-3.1-8b'}"]) == OK
    out = capsys.readouterr().out
    assert f"step programs: {programs} lowered for tpu" in out and hbm in out and "Pallas kernel VMEM" in out


def test_a_structured_output_that_does_not_compile_is_refused_by_the_head(run_model, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(f"name: s\nmodel:\n  path: {run_model}\n  dtype: float32\n"
                      "sampling:\n  json_schema:\n    type: nonsense\n")
    code = main([str(config), "--target", "cpu", "--engine.max_seq_len=128", "--engine.max_pages=64"])
    err = capsys.readouterr().err.strip()
    assert code == FAULT and "\n" not in err, err
    assert err.startswith("pagefleet check: refused: the head rejects the config: sampling.json_schema: ")
    assert "nonsense" in err
