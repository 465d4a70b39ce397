"""Model FLOPs of a forward pass: the one formula every benchmark that reports FLOP/s or a fraction of peak uses.

Only matmuls count, a multiply-add as 2 FLOPs, and only real (unpadded) tokens:

    flops = new_tokens * 2 * N_matmul  +  L * 4 * ctx_sum * H * d  +  logit_rows * 2 * h * V

N_matmul = L * (h * (H*d + 2*kvh*d) + H*d * h + 3 * h * I) is the non-embedding matmul parameters (q/k/v/o
projections and the gated MLP); ctx_sum is the sum over the new tokens of the number of tokens each attends to
(causal: position + 1), and 4 * ctx * H * d counts QK^T and PV. The LM head (2 * h * V) runs only on the rows
whose logits are returned. Norms, RoPE, softmax and the embedding lookup are left out.
"""

from __future__ import annotations

from engine.models.model_config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """N_matmul: the weights of the q/k/v/o projections and the gated MLP over all layers."""
    h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (h * (q_dim + 2 * kv_dim) + q_dim * h + 3 * h * cfg.intermediate_size)


def chunk_flops(cfg: ModelConfig, new_tokens: int, cached_tokens: int, logit_rows: int) -> int:
    """Model FLOPs of one sequence's `new_tokens` at positions `cached_tokens`, `cached_tokens` + 1, ...
    (fed in one pass or one per pass: the count is the same), returning logits on `logit_rows` of them."""
    start, end = cached_tokens, cached_tokens + new_tokens
    ctx_sum = (end * (end + 1) - start * (start + 1)) // 2  # sum of (position + 1) over the new tokens
    return (new_tokens * 2 * matmul_params(cfg) + cfg.num_layers * 4 * ctx_sum * cfg.num_heads * cfg.head_dim
            + logit_rows * 2 * cfg.hidden_size * cfg.vocab_size)
