"""The step programs lowered for TPU on a CPU machine, on an abstract mesh (no TPU, no weights)."""

import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.models.model_config import ModelConfig
from engine.sizing.preflight import TARGETS, LoweringFailed, abstract_mesh, lower_step_programs, sampling_mode


def small_model(head_dim: int = 128, kv_heads: int = 2) -> ModelConfig:
    """Two layers, heads of 128 (the Pallas kernel's lane width), GQA 2:1."""
    return ModelConfig.from_hf(dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                                    vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=1e4,
                                    eos_token_id=2))


# One bucket each: T=16 with prompt chunks, S=4 decode rows, 2 decode steps a call.
ENGINE = EngineConfig(page_size=16, max_pages=64, max_seqs=4, max_seqs_in_prefill=2, max_prefill_size=16,
                      decode_steps=2, max_seq_len=256)


@pytest.mark.parametrize("target", ["v5e", "v6e"])
def test_every_program_lowers_for_tpu_with_the_pallas_kernel(target):
    programs = lower_step_programs(small_model(), ENGINE, 256, "bfloat16", "truncate", 1,
                                   abstract_mesh(2, 2, TARGETS[target]), "tpu")
    assert [(p.name, p.tokens, p.seqs) for p in programs] == [
        ("step", 16, 4), ("decode", 4, 4), ("multi_step", 4, 4), ("chain", 4, 4)]
    for p in programs:
        if p.name == "chain":
            assert p.kernel is None and p.mosaic_calls == 0
        else:  # the kernel is in the lowered module, with the blocks the engine asks for on this TPU
            assert p.mosaic_calls >= 1
            assert p.kernel.device_kind == TARGETS[target].device.device_kind
            assert p.kernel.kv_pages_per_block == 16  # min(pages per sequence, the default 128)
            assert p.kernel.vmem_bytes < TARGETS[target].vmem_bytes_per_core


def test_cpu_lowering_has_no_mosaic_kernel():
    programs = lower_step_programs(small_model(), ENGINE, 256, "float32", "greedy", 1, abstract_mesh(1, 1, None), "cpu")
    assert len(programs) == 4 and all(p.mosaic_calls == 0 and p.kernel is None for p in programs)


def test_a_head_size_the_kernel_cannot_take_is_named():
    """The kernel broadcasts its softmax state over 128 lanes: a head of 16 does not lower (the tiny presets)."""
    with pytest.raises(LoweringFailed, match=r"the step program \(T=16 tokens, S=4 sequences\) does not lower for "
                                             r"tpu: AssertionError: .*ragged_paged_attention/kernel.py"):
        lower_step_programs(small_model(head_dim=16), ENGINE, 256, "bfloat16", "greedy", 1,
                            abstract_mesh(1, 1, TARGETS["v5e"]), "tpu")


def test_kv_heads_that_do_not_divide_the_mesh_are_refused():
    """3 devices neither divide the 2 KV heads nor are a multiple of them (engine/models/tensor_parallel.py)."""
    with pytest.raises(ValueError, match="cluster.mesh.model=3"):
        lower_step_programs(small_model(kv_heads=2), ENGINE, 256, "bfloat16", "greedy", 1,
                            abstract_mesh(3, 3, TARGETS["v5e"]), "tpu")


def test_a_mesh_wider_than_the_kv_heads_lowers_with_the_kv_heads_replicated():
    """One KV head over 2 devices: each device holds a copy of it (K and V, 2 combined heads) and 2 query heads."""
    programs = lower_step_programs(small_model(kv_heads=1), ENGINE, 256, "bfloat16", "greedy", 1,
                                   abstract_mesh(2, 2, TARGETS["v5e"]), "tpu")
    step = programs[0]
    assert step.mosaic_calls >= 1 and step.kernel.vmem_bytes < TARGETS["v5e"].vmem_bytes_per_core


def test_sampling_mode_follows_the_config():
    assert sampling_mode(SamplingConfig(temperature=0.0), 512) == "greedy"
    assert sampling_mode(SamplingConfig(temperature=0.7), 512) == "sample"
    assert sampling_mode(SamplingConfig(temperature=0.7, top_p=0.95), 512) == "truncate"
    assert sampling_mode(SamplingConfig(temperature=0.7, min_p=0.1), 512) == "truncate+min_p"
    assert sampling_mode(SamplingConfig(temperature=0.0, min_p=0.1), 512) == "greedy"  # min_p leaves greedy as is
    assert sampling_mode(SamplingConfig(repetition_penalty=1.2), 512) == "greedy+penalties"
    assert sampling_mode(SamplingConfig(temperature=0.7, top_k=5, min_p=0.1, frequency_penalty=0.5),
                         512) == "truncate+min_p+penalties"
    assert sampling_mode(SamplingConfig(min_tokens=4), 512) == "greedy+min_tokens"
    assert sampling_mode(SamplingConfig(temperature=0.7, ignore_eos=True), 512) == "sample"


@pytest.mark.parametrize("mode", ["greedy+penalties", "truncate+min_p+penalties", "sample+penalties+min_tokens"])
def test_programs_with_min_p_and_penalties_lower(mode):
    """The preflight's argument lists follow the runner's with the penalty arrays, min_p and the stop ids min_tokens
    holds back."""
    programs = lower_step_programs(small_model(), ENGINE, 256, "float32", mode, 3, abstract_mesh(1, 1, None), "cpu")
    assert [p.name for p in programs] == ["step", "decode", "multi_step", "chain"]
