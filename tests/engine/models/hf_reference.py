"""Hugging Face reference models for tests, written with transformers' own `save_pretrained`.

Weights are random at a scale where top-two logit gaps dwarf float32 rounding (logit std ~16), so
token-for-token equality with transformers means equality, not luck; tests check the gaps too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

from orchestrator.commands.generate import main as generate_main

FAMILIES = {
    "llama3": dict(cls="LlamaConfig", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}, rms_norm_eps=1e-5),
    "mistral": dict(cls="MistralConfig", rope_theta=10000.0, sliding_window=None, rms_norm_eps=1e-6),
    "qwen2": dict(cls="Qwen2Config", rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  use_sliding_window=False),
    # Gemma: a window shorter than most test prompts, the first layer sliding and the second full (Gemma 2's
    # default), caps low enough to bend real scores and logits, query_pre_attn_scalar other than head_dim.
    "gemma2": dict(cls="Gemma2Config", tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=24,
                   query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=12.0),
    # Gemma 3: sliding, sliding, full (layer_types written out), two RoPEs: the global one linearly scaled.
    "gemma3_text": dict(cls="Gemma3TextConfig", tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=24,
                        query_pre_attn_scalar=24, final_logit_softcapping=12.0, layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # head_dim 32 with 4 heads of a 64-wide model: Qwen3's explicit head_dim differs from hidden / heads.
    "qwen3": dict(cls="Qwen3Config", rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False, head_dim=32),
    # 8 experts, top-2, renormalized.
    "mixtral": dict(cls="MixtralConfig", rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
                    num_local_experts=8, num_experts_per_tok=2),
    # 6 experts of width 48, top-3, not renormalized; layer 1 of 3 dense (mlp_only_layers).
    "qwen3_moe": dict(cls="Qwen3MoeConfig", rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                      num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
                      mlp_only_layers=[1], layers=3),
    # Qwen2-MoE: qwen3_moe's experts (8 here) plus a shared expert of width 96 behind a sigmoid gate; q/k/v biases.
    "qwen2_moe": dict(cls="Qwen2MoeConfig", rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                      num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
                      shared_expert_intermediate_size=96, mlp_only_layers=[1], layers=3),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")  # mixtures of experts
GEMMA_NORMS = ("gemma2", "gemma3_text")  # RMSNorm as (1 + weight): weights drawn around 0, not 1


def make_hf_model(family: str, out: Path, *, hidden=64, layers=None, heads=4, kv_heads=2, head_dim=None,
                  intermediate=128, vocab=256, seed=0, max_shard_size=None, **overrides):
    """`head_dim` and `layers` default to the family's (16 and 2 unless FAMILIES says otherwise)."""
    spec = dict(FAMILIES[family])
    cls = getattr(transformers, spec.pop("cls"))
    head_dim = head_dim or spec.pop("head_dim", 16)
    spec.pop("head_dim", None)
    layers = layers or spec.pop("layers", 2)
    spec.pop("layers", None)
    config = cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                 vocab_size=vocab, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                 **{"tie_word_embeddings": False, **spec, **overrides})
    torch.manual_seed(seed)
    model = cls_model(config)
    randomize(model, hidden, seed, norm_center=0.0 if family in GEMMA_NORMS else 1.0)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return model


def make_hf_gemma3_multimodal(out: Path, *, vocab=512, seed=0):
    """A tiny Gemma3ForConditionalGeneration (the text model of the `gemma3_text` family above, a one-layer SigLIP
    vision tower), saved by transformers: its text tensors sit under `model.language_model.`."""
    spec = dict(FAMILIES["gemma3_text"])
    spec.pop("cls")
    layers = spec.pop("layers")
    text = transformers.Gemma3TextConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=vocab,
                                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, **spec)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
                                       image_token_index=vocab - 1, eos_token_id=[2, 7])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    randomize(model, 64, seed, norm_center=0.0)
    model.eval()
    model.save_pretrained(out)
    return model


def randomize(model, hidden: int, seed: int, norm_center: float) -> None:
    """Weights at a scale where top-two logit gaps dwarf float32 rounding (see the module docstring); norm weights
    around `norm_center` (1 for Llama's RMSNorm, 0 for Gemma's, which multiplies by 1 + weight)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                value = norm_center + 0.1 * rng.standard_normal(p.shape)
            elif name.endswith("bias"):
                value = 0.1 * rng.standard_normal(p.shape)
            elif "embed_tokens" in name:
                value = rng.standard_normal(p.shape)
            elif name == "lm_head.weight":
                value = rng.standard_normal(p.shape) * 16 / np.sqrt(hidden)
            elif p.ndim == 2 or (p.ndim == 3 and "experts" in name):  # Linear [out, in], experts [experts, out, in]
                value = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
            else:  # vision tower biases, norms, convolutions: what transformers drew
                continue
            p.copy_(torch.tensor(value, dtype=torch.float32))
    model.eval()


def cls_model(config):
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """transformers' greedy `generate`, never stopping early; returns tokens and the smallest top-2 logit gap."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores)[:, 0]  # [steps, vocab]
    top2 = torch.topk(scores, 2, dim=-1).values
    return out.sequences[0, len(prompt):].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def hf_greedy_logprobs(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float], float]:
    """transformers' greedy `generate` (batch 1, never stopping early): tokens, each one's logprob, and the
    smallest top-2 logit gap."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0].double()  # [steps, vocab]
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    top2 = torch.topk(logits, 2, dim=-1).values
    return tokens.tolist(), logprobs.tolist(), float((top2[:, 0] - top2[:, 1]).min())


def prompts_1_to_250(count: int, seed: int, vocab: int, edges: tuple[int, int, int] = (15, 16, 17)) -> list[list[int]]:
    """`count` prompts of token ids in [6, vocab): lengths 1, 2, the three `edges` (a page or a window and one on
    either side), 249, 250, and the rest drawn from 1 to 250."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2, *edges, 249, 250], rng.integers(1, 251, count - 7)])
    return [rng.integers(6, vocab, int(n)).tolist() for n in lengths]


def generate_records(model_dir: Path, work: Path, prompts: list[list[int]], new_tokens: int,
                     max_pages: int = 60) -> list[dict]:
    """`pagefleet generate`'s records of `prompts` (given as token ids), greedy with logprobs, `new_tokens` each, 6 at
    once in `max_pages` pages of 16 with the engine's invariants checked: small enough that some are preempted (asserted)."""
    (work / "in.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n"
                                           for i, p in enumerate(prompts)))
    out, stats_file = work / "out.jsonl", work / "stats.json"
    code = generate_main(["--model", str(model_dir), "--input", str(work / "in.jsonl"),
                          "--output", str(out), "--stats_output", str(stats_file), "--progress=false",
                          f"--sampling.max_new_tokens={new_tokens}", "--sampling.temperature=0",
                          "--sampling.logprobs=true", "--engine.page_size=16", f"--engine.max_pages={max_pages}",
                          "--engine.max_seqs=6", "--engine.max_seqs_in_prefill=3", "--engine.max_prefill_size=128",
                          "--engine.max_seq_len=320", "--engine.debug_invariants=true"])
    assert code == 0
    assert json.loads(stats_file.read_text())["num_preemptions"] > 0, "the test must exercise preemption"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == [f"p{i}" for i in range(len(prompts))]
    return records


def varied_prompts(vocab: int, count: int = 64, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 1 to 400 tokens (the edges 1, 2, 15-17, 399, 400 included), ids in [6, vocab)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2, 15, 16, 17, 399, 400], rng.integers(1, 401, count - 7)])
    return [rng.integers(6, vocab, int(n)).tolist() for n in lengths]
