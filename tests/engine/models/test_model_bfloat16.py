"""bfloat16 end to end (the dtype of every TPU run): weights and KV pool in bfloat16 against transformers in
bfloat16 (CPU torch), one test per family preset.

The tolerance, from bfloat16 rounding. bfloat16 keeps 8 significant bits: rounding moves a value by at most
half a unit in the last place, 2**-9 of it. Both sides hold the same bfloat16 weights (round-to-nearest-even of
the same float32 checkpoint), so they differ only where they round activations: transformers rounds every
matmul output, the RoPE products, the attention scores and probabilities and finally the logits to bfloat16;
the engine computes norms, RoPE, attention and the logits in float32 and rounds the projections' outputs and
the KV pool. Per layer about R = 4 differently rounded tensors feed the residual stream (attention output,
two residual sums, the MLP product); the stream is re-normalised every layer, so their relative errors add,
randomly signed, to about sqrt(R * L) * 2**-9 of the stream's scale after L layers (2.8 * 2**-9 for L = 2,
3.5 * 2**-9 for L = 3), and the lm_head carries that into every logit in proportion to the logits' scale.
transformers' final rounding of the logits adds 2**-9 of each logit. That is 4 to 4.5 * 2**-9 = about 2 ulps;
we allow twice that: 4 ulps, 4 * 2**-8 (1.6%) of the row's largest |logit|. (Measured on these presets: 0.5%
to 1.2%, i.e. 1.3 to 3 ulps.)

Greedy tokens: when every logit of a row is within `tol` of transformers', the argmax can differ only where
transformers' top-2 margin is at most 2 * tol. So the tokens must be identical at every step whose margin
exceeds 2 * tol. Both sides decode from the same context (transformers' greedy tokens, fed to the engine), so a
near-tie that may go either way does not part the contexts of the steps after it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.models.presets import write_model
from engine.device.runner import ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.weights import load_transformer
from tests.engine.models.test_model import MODEL_SEEDS, NEW_TOKENS, PagedSequences, make_prompts

ULP = 2.0**-8  # bfloat16's unit in the last place, relative (8 significant bits)
TOL_ULPS = 4  # see the module docstring


def hf_greedy_margins(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """transformers' greedy tokens, never stopping early, with each step's top-2 margin and largest |logit|."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    scores = torch.stack(out.scores)[:, 0].float()  # [steps, vocab]
    top2 = torch.topk(scores, 2, dim=-1).values
    return (out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).numpy(),
            scores.abs().max(dim=-1).values.numpy())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_bfloat16_matches_transformers_in_bfloat16(tmp_path, preset):
    path = write_model(preset, tmp_path, seed=MODEL_SEEDS[preset])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load_transformer(path, dtype=jnp.bfloat16)
    assert model.layers.attn.wq.array.dtype == jnp.bfloat16
    runner = ModelRunner(model, RunnerConfig.of(EngineConfig(page_size=16, max_pages=256, max_seqs=8,
                                                          max_prefill_size=256)),
                         max_seq_len=512, kv_dtype=jnp.bfloat16)
    assert runner.kv.pool.array.dtype == jnp.bfloat16
    prompts = make_prompts(model.config.vocab_size)
    seqs = PagedSequences(runner, prompts)
    logits = seqs.prefill(chunk_tokens=64, step_tokens=160)  # long prompts span several steps
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float().numpy()
        tol = TOL_ULPS * ULP * np.abs(ref).max()
        np.testing.assert_allclose(logits[s], ref, atol=tol, rtol=0, err_msg=f"{preset} prompt {s} (len {len(prompt)})")

    # Greedy decoding, teacher-forced with transformers' greedy tokens so that both sides see the same context at
    # every step (a near-tie that picks another token would otherwise part the contexts for the rest).
    refs = [hf_greedy_margins(hf, prompt, NEW_TOKENS) for prompt in prompts]
    compared = 0
    step_logits = logits
    for i in range(NEW_TOKENS):
        for s, (ref_tokens, margins, scales) in enumerate(refs):
            tol = TOL_ULPS * ULP * scales[i]
            ours = int(np.argmax(step_logits[s]))
            if margins[i] > 2 * tol:  # beyond any flip the tolerance allows: the token must be the same
                assert ours == ref_tokens[i], (f"{preset} prompt {s} step {i}: token {ours} != transformers' "
                                               f"{ref_tokens[i]} with a top-2 margin of {margins[i]:.3f} > {2 * tol:.3f}")
                compared += 1
        if i + 1 < NEW_TOKENS:
            for s, (ref_tokens, _, _) in enumerate(refs):
                seqs.tokens[s].append(ref_tokens[i])
            seqs._reserve([len(t) for t in seqs.tokens])
            step_logits = runner.logits([SeqChunk([t[-1]], len(t) - 1, p) for t, p in zip(seqs.tokens, seqs.pages)])
    # Most steps have a clear margin (about 2 in 3 on these presets): the comparison is not vacuous.
    assert compared >= 0.5 * len(prompts) * NEW_TOKENS, compared
