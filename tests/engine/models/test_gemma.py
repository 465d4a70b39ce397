"""Gemma 2 and Gemma 3 against transformers (CPU torch, float32): `pagefleet generate` end to end, each module of
the layer, the multimodal checkpoint's text model, and config.json read in both of its forms."""

from __future__ import annotations

import json
import re
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from jax.sharding import Mesh

from engine.config import EngineConfig, SamplingConfig
from engine.device.runner import ModelRunner
from engine.device.runner_config import RunnerConfig
from engine.engine import Engine
from engine.models.axes import EMBED
from engine.models.checkpoint_check import check_checkpoint
from engine.models.gemma_model import gemma_rms_norm
from engine.models.model_config import LinearRopeScaling, ModelConfig, UnsupportedModelError
from engine.models.weights import load_transformer
from engine.scheduling.sequence import Request
from orchestrator.commands.check import main as check_main
from orchestrator.commands.size import main as size_main
from orchestrator.exit_codes import OK
from tests.engine.models.hf_reference import (generate_records, hf_greedy_logprobs, make_hf_gemma3_multimodal,
                                            make_hf_model, prompts_1_to_250)
from tests.engine.models.test_model import PagedSequences, make_prompts

GEMMAS = ["gemma2", "gemma3_text"]
VOCAB = 512
MIN_GAP = 1e-3
# Seeds whose greedy runs hold no near-tie (asserted below: every top-2 gap > MIN_GAP).
SEEDS = {"gemma2": 0, "gemma3_text": 0}


@pytest.mark.parametrize("family", GEMMAS)
def test_generate_greedy_tokens_and_logprobs_equal_transformers(tmp_path, family):
    """16 prompts of 1 to 250 tokens (the window is 24: most prompts slide past it) through `pagefleet generate`,
    40 new tokens each, 6 at once in 24 pages of 16 (preemption asserted): transformers' greedy tokens, and
    logprobs within 1e-4."""
    new_tokens = 40
    hf = make_hf_model(family, tmp_path / "model", vocab=VOCAB, seed=SEEDS[family])
    prompts = prompts_1_to_250(16, seed=1, vocab=VOCAB, edges=(23, 24, 25))
    # The sliding layers hold their window's pages only (engine.kv_groups): a smaller pool makes the 6 preempt.
    records = generate_records(tmp_path / "model", tmp_path, prompts, new_tokens, max_pages=24)
    for i, (p, r) in enumerate(zip(prompts, records)):
        tokens, logprobs, gap = hf_greedy_logprobs(hf, p, new_tokens)
        assert gap > MIN_GAP, f"{family} prompt {i}: top-2 gap {gap} too small for the comparison to mean anything"
        assert r["finish_reason"] == "length" and r["token_ids"] == tokens, f"{family} prompt {i} (len {len(p)})"
        np.testing.assert_allclose(r["logprobs"], logprobs, atol=1e-4, rtol=0, err_msg=f"{family} prompt {i}")


def test_gemma_rms_norm_equals_transformers():
    """(1 + weight), in float32, over the hidden size and (QK-norm) over a head: 1e-5."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32) * 3
    w = (0.1 * rng.standard_normal(64)).astype(np.float32)
    norm = transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
        ref = norm(torch.tensor(x)).numpy()
    T, E = hax.Axis("token", 5), hax.Axis(EMBED, 64)
    got = gemma_rms_norm(hax.named(jnp.asarray(x), (T, E)), hax.named(jnp.asarray(w), (E,)), 1e-6)
    np.testing.assert_allclose(np.asarray(got.array), ref, atol=1e-5, rtol=0)


def test_a_multimodal_gemma3_checkpoint_runs_its_text_model_and_refuses_image_tokens(tmp_path):
    """Gemma3ForConditionalGeneration as transformers saves it: config.json nests text_config, and the text tensors
    sit under language_model.model. (what transformers 5 writes, as the released checkpoints have them; its
    modules' own names, model.language_model., load too). The engine's logits are transformers' (text only)
    within 1e-4, and a prompt holding the image token is refused in one line naming it."""
    hf = make_hf_gemma3_multimodal(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gemma3" and "text_config" in config and "vocab_size" not in config
    stored = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in stored
    assert not any(name.startswith("model.") for name in stored)
    prompts = make_prompts(500, seed=2)[:5]
    with torch.no_grad():
        refs = [hf(input_ids=torch.tensor([prompt])).logits[0, -1].numpy() for prompt in prompts]
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed" / "config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file({name.replace("language_model.model.", "model.language_model."): value
                                 for name, value in stored.items()}, tmp_path / "renamed" / "model.safetensors")
    for path in (tmp_path, tmp_path / "renamed"):
        runner = ModelRunner(load_transformer(path), RunnerConfig.of(EngineConfig(page_size=4, max_pages=200)),
                             max_seq_len=512)
        logits = PagedSequences(runner, prompts).prefill(chunk_tokens=40, step_tokens=100)
        for s, ref in enumerate(refs):
            np.testing.assert_allclose(logits[s], ref, atol=1e-4, rtol=0, err_msg=f"{path} prompt {s}")
    engine = Engine(tmp_path, EngineConfig(max_pages=64, max_seq_len=256))
    sampling = SamplingConfig(max_new_tokens=4)
    image, text = engine.generate([Request("img", (10, 511, 12), sampling), Request("txt", (10, 11, 12), sampling)])
    assert image.error == ("image_input: the prompt holds the image token 511; pagefleet runs the text model of "
                           "this multimodal checkpoint only: send text prompts")
    assert text.error is None and len(text.token_ids) == 4
    assert engine.eos_token_ids >= {2, 7}  # the outer config.json's eos_token_id


RELEASED_27B = Path(__file__).resolve().parents[3] / "configs" / "models" / "gemma-3-27b-it"


def test_released_and_transformers5_config_forms_read_the_same():
    """Gemma-3-27B's published config.json (released form: rope_scaling, no rope_local_base_freq, no vocab_size)
    and the one transformers 5 writes for it (rope_parameters per layer type, every field) give one ModelConfig,
    and it is what transformers itself reads."""
    released = ModelConfig.from_pretrained(RELEASED_27B)
    t5 = transformers.AutoConfig.from_pretrained(RELEASED_27B)
    rewritten = ModelConfig.from_hf(t5.to_dict())
    assert rewritten == released
    text = t5.text_config
    assert (released.vocab_size, released.num_layers, released.head_dim) == (text.vocab_size, 62, 128)
    assert released.style.layer_types == tuple(text.layer_types) and released.sliding_window == 1024
    assert released.rope_scaling == LinearRopeScaling(8.0) and released.rope_theta == 1e6
    assert released.style.local_rope_theta == 1e4 and released.attn_scale == 168**-0.5
    assert released.eos_token_ids == (1, 106) and released.image_token_id == 262144
    assert sum(t == "full_attention" for t in released.style.layer_types) == 10


BASE = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}


@pytest.mark.parametrize("extra, field", [
    ({"hidden_activation": "gelu"}, "config.json hidden_activation='gelu'"),
    ({"use_bidirectional_attention": True}, "config.json use_bidirectional_attention=true"),
    ({"attention_bias": True}, "config.json attention_bias=true"),
    ({"layer_types": ["full_attention"]}, "config.json layer_types"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "config.json layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope_type='yarn'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ({"final_logit_softcapping": -1.0}, "config.json final_logit_softcapping=-1.0"),
    ({"sliding_window_pattern": 0}, "config.json sliding_window_pattern=0"),
    ({"model_type": "gemma3", "vision_config": {}}, "config.json of a gemma3 checkpoint has no text_config"),
])
def test_unsupported_gemma_configs_are_refused_in_one_line_naming_the_field(tmp_path, extra, field):
    """Before any tensor is read: `check_checkpoint` (the head's check) refuses from config.json alone."""
    with pytest.raises(UnsupportedModelError, match=re.escape(field)) as err:
        ModelConfig.from_hf({**BASE, **extra})
    assert "\n" not in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    with pytest.raises(UnsupportedModelError, match=re.escape(field)):
        check_checkpoint(tmp_path)  # no safetensors file here: the config alone is refused


def test_pagefleet_size_counts_gemma_3_27b(capsys):
    """The published config: 27.0B parameters (its text model), its 62 layers' KV, a split on a v6e-8."""
    assert size_main(["--model", str(RELEASED_27B), "--chip", "v6e", "--chips", "8", "--tp", "8",
                      "--prompt-tokens", "2048", "--new-tokens", "1024"]) == OK
    out = capsys.readouterr().out
    assert "parameters: 27,009,346,304" in out and "KV per token: 507,904 bytes" in out
    assert "engine.max_pages: 17698" in out


@pytest.mark.slow
@pytest.mark.parametrize("config, programs, hbm", [("gemma3-27b-v5p-8.yaml", 20, "of 95.00 GiB"),
                                                   ("gemma3-27b-v6e-8.yaml", 20, "of 29.80 GiB")])
def test_the_shipped_gemma_configs_pass_check_for_their_targets(config, programs, hbm, capsys):
    """About a minute each on a CPU host: the step programs of 62 unrolled layers (31 layer groups' page tables)
    lowered for the slice's TPU."""
    assert check_main([str(RELEASED_27B.parents[1] / config), f"--model.path={RELEASED_27B}"]) == OK
    out = capsys.readouterr().out
    assert f"step programs: {programs} lowered for tpu" in out and hbm in out and "fits" in out


@pytest.mark.parametrize("family", GEMMAS)
def test_tensor_parallel_and_bfloat16_run_gemma(tmp_path, family):
    """Over a `model` axis of 4 (QK-norm and Gemma's norms replicated, heads split): the single device's logits
    within 1e-4 and its greedy tokens. In bfloat16: logits within bf16 precision of float32."""
    make_hf_model(family, tmp_path, heads=8, kv_heads=4, head_dim=8, intermediate=96, vocab=VOCAB)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
    engine = EngineConfig(page_size=8, max_pages=128, max_prefill_size=256)
    prompts = make_prompts(VOCAB, seed=1)[:6]
    results = []
    for m in (None, mesh):
        runner = ModelRunner(load_transformer(tmp_path, mesh=m), RunnerConfig.of(engine), max_seq_len=512, mesh=m)
        seqs = PagedSequences(runner, prompts)
        logits = seqs.prefill(chunk_tokens=48, step_tokens=128)
        results.append((logits, seqs.greedy(logits, 12)))
    np.testing.assert_allclose(results[1][0], results[0][0], atol=1e-4, rtol=0)
    assert results[1][1] == results[0][1]
    model = load_transformer(tmp_path, dtype=jnp.bfloat16)
    assert model.layers.attn.wq.array.dtype == jnp.bfloat16
    bf16 = PagedSequences(ModelRunner(model, RunnerConfig.of(engine), max_seq_len=512, kv_dtype=jnp.bfloat16), prompts).prefill(
        chunk_tokens=48, step_tokens=128)
    f32 = results[0][0]
    assert 0 < np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()
