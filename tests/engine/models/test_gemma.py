"""Gemma 2 and Gemma 3 against transformers (CPU torch, float32): `pagefleet generate` end to end, each module of
the layer, the multimodal checkpoint's text model, and config.json read in both of its forms."""

from __future__ import annotations

import json

import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from engine.models.axes import EMBED
from engine.models.gemma_model import gemma_rms_norm
from orchestrator.commands.generate import main as generate_main
from tests.engine.models.hf_reference import make_hf_model

GEMMAS = ["gemma2", "gemma3_text"]
VOCAB = 512
MIN_GAP = 1e-3
# Seeds whose greedy runs hold no near-tie (asserted below: every top-2 gap > MIN_GAP).
SEEDS = {"gemma2": 0, "gemma3_text": 0}


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


def prompts_1_to_250(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([[1, 2, 23, 24, 25, 249, 250], rng.integers(1, 251, count - 7)])
    return [rng.integers(6, VOCAB, int(n)).tolist() for n in lengths]


@pytest.mark.parametrize("family", GEMMAS)
def test_generate_greedy_tokens_and_logprobs_equal_transformers(tmp_path, family):
    """16 prompts of 1 to 250 tokens (the window is 24: most prompts slide past it) through `pagefleet generate`,
    40 new tokens each, 6 at once in 90 pages of 16 (preemption asserted): transformers' greedy tokens, and
    logprobs within 1e-4."""
    new_tokens = 40
    hf = make_hf_model(family, tmp_path / "model", vocab=VOCAB, seed=SEEDS[family])
    prompts = prompts_1_to_250(16, seed=1)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": p}) + "\n"
                                               for i, p in enumerate(prompts)))
    out, stats_file = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code = generate_main(["--model", str(tmp_path / "model"), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(out), "--stats_output", str(stats_file), "--progress=false",
                          f"--sampling.max_new_tokens={new_tokens}", "--sampling.temperature=0",
                          "--sampling.logprobs=true", "--engine.page_size=16", "--engine.max_pages=60",
                          "--engine.max_seqs=6", "--engine.max_seqs_in_prefill=3", "--engine.max_prefill_size=128",
                          "--engine.max_seq_len=320", "--engine.debug_invariants=true"])
    assert code == 0
    assert json.loads(stats_file.read_text())["num_preemptions"] > 0, "the test must exercise preemption"
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == [f"p{i}" for i in range(len(prompts))]
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
