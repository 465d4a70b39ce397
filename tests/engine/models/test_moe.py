"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers (CPU torch, float32): the MoE block, `pagefleet
generate` end to end, rows independent of their neighbours in the grouped matmul, and the fields refused."""

from __future__ import annotations

import json

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.model_config import ModelConfig, UnsupportedModelError
from engine.models.moe import (GENERATED_TILE_ROWS, GRANULES_PER_TILE, TILE_SIZES, SharedExpert, _expert, _moe_rows,
                               _small_tiled_mlp, _tiled_grouped_mlp, expert_tiles, shared_expert)
from engine.models.presets import write_model
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import (MOE_FAMILIES, generate_records, hf_greedy_logprobs, make_hf_model,
                                              prompts_1_to_250)

VOCAB = 512
MIN_GAP = 1e-3
MOES = list(MOE_FAMILIES)
SEEDS = {"mixtral": 0, "qwen3_moe": 0, "qwen2_moe": 0}  # seeds whose greedy runs hold no near-tie (asserted: top-2 gap > MIN_GAP)


def _block(hf, layer: int = 0):
    """transformers' MoE block of `layer`, and our weights for it: router [H, E], gate/up [E, H, I], down [E, I, H]."""
    mlp = hf.model.layers[layer].mlp
    gate_up, down = mlp.experts.gate_up_proj.detach().numpy(), mlp.experts.down_proj.detach().numpy()
    size = down.shape[-1]
    weights = (mlp.gate.weight.detach().numpy().T, gate_up[:, :size].transpose(0, 2, 1),
               gate_up[:, size:].transpose(0, 2, 1), down.transpose(0, 2, 1))
    return mlp, [jnp.asarray(w) for w in weights]


@pytest.fixture(scope="module")
def native_kernels():
    """The native CPU kernels, loaded (built on first use; a machine without a C++ compiler fails here, loudly)."""
    from engine.kernels import cpu_attention
    cpu_attention.load()
    return cpu_attention


def test_native_generated_experts_give_each_pair_its_bits_alone(native_kernels):
    """The native grouped matmul: whatever its expert's count (0 to 40 pairs: items of 16 and a last partial one) and
    whichever pairs share the call, each pair has the bits of its row alone; sizes past the last vector block and the
    last block of 8 weight rows (75 wide, experts 43 wide) too; pairs of no expert (another device's) are zeros; and
    each is within 1e-5 of a float64 reference."""
    rng = np.random.default_rng(11)
    num_experts, k, hidden, width = 6, 3, 75, 43
    w = [rng.standard_normal(shape).astype(np.float32) * 0.2
         for shape in ((num_experts, hidden, width), (num_experts, hidden, width), (num_experts, width, hidden))]
    counts = [1, 16, 17, 0, 40, 3, 5]  # the last: no expert here
    pair_expert = rng.permutation(np.repeat(np.arange(num_experts + 1), counts)).astype(np.int32)
    pair_expert = np.concatenate([pair_expert, np.full(-len(pair_expert) % k, num_experts, np.int32)])
    x = rng.standard_normal((len(pair_expert) // k, hidden)).astype(np.float32)
    call = jax.jit(native_kernels.moe_experts)
    got = np.asarray(call(jnp.asarray(x), jnp.asarray(pair_expert), *map(jnp.asarray, w)))
    for p, e in enumerate(pair_expert):
        if e == num_experts:
            assert not got[p].any()
            continue
        row = x[p // k].astype(np.float64)
        gate, up = row @ w[0][e].astype(np.float64), row @ w[1][e].astype(np.float64)
        np.testing.assert_allclose(got[p], (gate / (1 + np.exp(-gate)) * up) @ w[2][e].astype(np.float64),
                                   atol=1e-5, rtol=0)
        lone = np.full_like(pair_expert, num_experts)
        lone[p] = e
        np.testing.assert_array_equal(got[p], np.asarray(call(jnp.asarray(x), jnp.asarray(lone),
                                                              *map(jnp.asarray, w)))[p])


@pytest.mark.parametrize("family", MOES)
# ragged_dot; expert tiles of 64 rows (the CPU's form) for prompt tokens; generated tokens' experts in the native
# library's grouped matmul (the CPU's decode path)
@pytest.mark.parametrize("tile, native", [(0, False), (64, False), (64, True)], ids=["ragged_dot", "tiles", "native"])
def test_moe_block_equals_transformers(tmp_path, family, tile, native, request):
    """The router (softmax, top-k, renormalized as the family says) and the experts' weighted sum, plus Qwen2-MoE's
    gated shared expert: 1e-5."""
    if native:
        request.getfixturevalue("native_kernels")
    hf = make_hf_model(family, tmp_path, seed=1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    mlp, weights = _block(hf)
    x = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    with torch.no_grad():
        ref = mlp(torch.tensor(x)[None])[0].numpy()
    generated = jnp.full(len(x), native)
    got = jax.jit(lambda x, *w: _moe_rows(x, *w, cfg.moe, tile, generated=generated, native=native))(
        jnp.asarray(x), *weights)
    if family == "qwen2_moe":
        assert cfg.moe.shared_expert_size == 96
        got = got + shared_expert(hax.named(jnp.asarray(x), ("token", "embed")), _shared(mlp)).array
    else:
        assert cfg.moe.shared_expert_size == 0
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=0)


def _shared(mlp) -> SharedExpert:
    """transformers' shared expert and its gate (Qwen2-MoE) as ours: [embed, shared_mlp] ..., gate [embed, 1]."""
    w = lambda linear: jnp.asarray(linear.weight.detach().numpy().T)  # noqa: E731
    e = mlp.shared_expert
    return SharedExpert(w_gate=hax.named(w(e.gate_proj), ("embed", "shared_mlp")),
                        w_up=hax.named(w(e.up_proj), ("embed", "shared_mlp")),
                        w_down=hax.named(w(e.down_proj), ("shared_mlp", "embed")),
                        gate=hax.named(w(mlp.shared_expert_gate), ("embed", "shared_gate")))


@pytest.mark.parametrize("tile", [0, 64])
@pytest.mark.parametrize("width", [2, 4])
def test_experts_spread_over_devices_give_one_devices_bits(tmp_path, tile, width):
    """Expert parallelism: the 8 experts spread over 2 or 4 devices of `model` (each holds 8 / width whole experts,
    routes every row and runs only its own experts' pairs; the pairs' outputs are summed over `model`) give the MoE
    block's output of one device bit for bit in expert tiles (the CPU's form), with padding rows past `num_rows` and
    rows of generated tokens (their experts' own matmuls) among the prompt tokens'.
    ragged_dot (TPU and GPU) within float32 rounding here: XLA's CPU backend lowers it as a masked pass over every
    expert, whose rounding follows the number of experts a device holds."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from engine.models.moe import MoeMlp, moe_mlp
    import haliax as hax

    hf = make_hf_model("mixtral", tmp_path, seed=1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    _, (router, w_gate, w_up, w_down) = _block(hf)
    x = hax.named(jnp.asarray(np.random.default_rng(2).standard_normal((100, 64)).astype(np.float32)),
                  ("token", "embed"))
    mesh = Mesh(np.array(jax.devices()[:width]).reshape(1, width), ("data", "model"))

    def moe(where):
        place = (lambda w, spec: w) if where is None else (lambda w, spec: jax.device_put(w, NamedSharding(mesh, spec)))
        experts = P("model", None, None)
        return MoeMlp(router=hax.named(place(router, P()), ("embed", "routes")),
                      w_gate=hax.named(place(w_gate, experts), ("experts", "embed", "expert_mlp")),
                      w_up=hax.named(place(w_up, experts), ("experts", "embed", "expert_mlp")),
                      w_down=hax.named(place(w_down, experts), ("experts", "expert_mlp", "embed")))

    generated = jnp.arange(100) % 3 == 1
    f = jax.jit(lambda x, moe, n, mesh_: moe_mlp(x, moe, cfg.moe, tile, n if tile else None, mesh_, generated).array,
                static_argnums=3)
    one = np.asarray(f(x, moe(None), jnp.int32(91), None))
    spread = np.asarray(f(x, moe(mesh), jnp.int32(91), mesh))
    if tile:
        assert np.abs(one[:91]).min() > 0 and (one[91:] == 0).all()
        np.testing.assert_array_equal(spread, one)
    else:
        np.testing.assert_allclose(spread, one, atol=1e-6, rtol=0)


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(tmp_path):
    """In expert tiles of 64 rows, the same row routed with 63 other rows, with 255 or 1,023 others (an expert's rows
    then run in matmuls of 128 and 256 rows), or alone (padded to the tile) gives the same bits: every expert matmul
    has at least 64 rows, whoever shares it."""
    hf = make_hf_model("mixtral", tmp_path, seed=1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    _, weights = _block(hf)
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((1024, 64)).astype(np.float32)
    f = jax.jit(lambda x, *w: _moe_rows(x, *w, cfg.moe, 64))
    alone = np.stack([np.asarray(f(jnp.asarray(np.pad(rows[i:i + 1], ((0, 63), (0, 0)))), *weights))[0]
                      for i in range(0, 1024, 37)])
    for n in (64, 256, 1024):
        together = np.asarray(f(jnp.asarray(rows[:n]), *weights))
        np.testing.assert_array_equal(together[0:n:37], alone[:len(range(0, n, 37))])
    shuffled = rng.permutation(256)
    mixed = np.asarray(f(jnp.asarray(rows[shuffled]), *weights))
    np.testing.assert_array_equal(mixed[np.argsort(shuffled)], np.asarray(f(jnp.asarray(rows[:256]), *weights)))


def test_rows_past_num_rows_go_to_no_expert(tmp_path):
    """A step's rows past its real tokens (its padding up to the shape bucket) are routed to no expert: the experts
    compute no tile for them, their outputs are zeros, and the real rows keep their bits."""
    hf = make_hf_model("mixtral", tmp_path, seed=1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    _, weights = _block(hf)
    rows = np.random.default_rng(6).standard_normal((300, 64)).astype(np.float32)
    f = jax.jit(lambda x, n, *w: _moe_rows(x, *w, cfg.moe, 64, n))
    full = np.asarray(f(jnp.asarray(rows), 300, *weights))
    for n in (1, 130, 299):
        got = np.asarray(f(jnp.asarray(rows), n, *weights))
        np.testing.assert_array_equal(got[:n], full[:n])
        assert not got[n:].any(), f"rows past {n} were computed"


def test_expert_tiles_cover_any_granule_count_exactly_in_matmuls_of_a_tile_or_more():
    granules = jnp.asarray([0] + list(range(GRANULES_PER_TILE, 80)), jnp.int32)
    tiles = expert_tiles(granules)
    assert min(TILE_SIZES) >= GRANULES_PER_TILE and set(tiles) == set(TILE_SIZES)
    assert all((np.asarray(n) >= 0).all() for n in tiles.values())
    np.testing.assert_array_equal(sum(size * np.asarray(n) for size, n in tiles.items()), np.asarray(granules))


def test_each_pair_has_its_bits_from_a_lone_tile_whatever_its_experts_count():
    """Experts' pair counts that run in every matmul size (64 to 256 rows, 32-row granules, and the splits that
    borrow from a larger matmul) give each pair the bits of its row alone in a 64-row matmul of its expert's weights;
    an expert pads its pairs to less than a granule more (or to one tile)."""
    rng = np.random.default_rng(8)
    num_experts, k, hidden, width = 8, 2, 64, 96
    w = [jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.float32)
         for shape in ((num_experts, hidden, width), (num_experts, hidden, width), (num_experts, width, hidden))]
    counts = [1, 65, 81, 150, 170, 0, 257, 300]  # 64, 96, 96, 64 + 96 (from a 128), 128 + 64, -, 128 + 64 + 96 (from
    # a 256), 256 + 64 rows
    pair_expert = rng.permutation(np.repeat(np.arange(num_experts), counts)).astype(np.int32)
    pair_expert = np.concatenate([pair_expert, np.full(len(pair_expert) % k, num_experts, np.int32)])  # whole rows
    x = rng.standard_normal((len(pair_expert) // k, hidden)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, pe: _tiled_grouped_mlp(x, k, pe, tuple(w), 64))(jnp.asarray(x),
                                                                                      jnp.asarray(pair_expert)))
    alone = jax.jit(lambda row, e: _expert(jnp.pad(row[None], ((0, 63), (0, 0))), *(v[e] for v in w))[0])
    for p in rng.choice(len(pair_expert), 120, replace=False):
        if pair_expert[p] == num_experts:
            assert not got[p].any()
        else:
            np.testing.assert_array_equal(got[p], np.asarray(alone(jnp.asarray(x[p // k]), pair_expert[p])))


def test_each_generated_pair_has_its_bits_from_a_lone_matmul_of_the_generated_tile():
    """Generated tokens' pairs (engine/models/moe.py): whatever its expert's count (0 to 300 pairs), each pair has
    the bits of its row alone in a matmul of GENERATED_TILE_ROWS rows of its expert's weights, 256 wide (XLA's CPU
    matmuls of 8 and 64 rows round a row differently there). And in a block of prompt and generated rows, each row
    has the bits it has in a block of its kind alone."""
    rng = np.random.default_rng(9)
    num_experts, k, hidden, width, n = 8, 2, 256, 256, GENERATED_TILE_ROWS
    w = [jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32)
         for shape in ((num_experts, hidden, width), (num_experts, hidden, width), (num_experts, width, hidden))]
    counts = [1, 7, 8, 9, 0, 65, 300, 3]
    pair_expert = rng.permutation(np.repeat(np.arange(num_experts), counts)).astype(np.int32)
    pair_expert = np.concatenate([pair_expert, np.full(len(pair_expert) % k, num_experts, np.int32)])  # whole rows
    x = rng.standard_normal((len(pair_expert) // k, hidden)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, pe: _small_tiled_mlp(x, k, pe, tuple(w)))(jnp.asarray(x),
                                                                                 jnp.asarray(pair_expert)))
    alone = jax.jit(lambda row, e: _expert(jnp.pad(row[None], ((0, n - 1), (0, 0))), *(v[e] for v in w))[0])
    for p in rng.choice(len(pair_expert), 120, replace=False):
        if pair_expert[p] == num_experts:
            assert not got[p].any()
        else:
            np.testing.assert_array_equal(got[p], np.asarray(alone(jnp.asarray(x[p // k]), pair_expert[p])))

    class Moe:
        top_k, renormalize = k, True
    router = jnp.asarray(rng.standard_normal((hidden, num_experts)), jnp.float32)
    block = jax.jit(lambda x, g: _moe_rows(x, router, *w, Moe, 64, generated=g))
    generated = rng.random(len(x)) < 0.5
    mixed = np.asarray(block(jnp.asarray(x), jnp.asarray(generated)))
    for kind in (True, False):
        rows = np.flatnonzero(generated == kind)
        np.testing.assert_array_equal(mixed[rows], np.asarray(block(jnp.asarray(x[rows]), jnp.full(len(rows), kind))))


@pytest.mark.parametrize("family", MOES)
def test_generate_greedy_tokens_and_logprobs_equal_transformers(tmp_path, family):
    """16 prompts of 1 to 250 tokens through `pagefleet generate`, 40 new tokens each, 6 at once in 60 pages of 16
    (preemption asserted): transformers' greedy tokens (batch 1), and logprobs within 1e-4. Mixtral: 8 experts,
    top-2; Qwen3-MoE: 6 experts, top-3, not renormalized, its middle layer dense; Qwen2-MoE: as Qwen3-MoE with 8
    experts, a gated shared expert and q/k/v biases."""
    new_tokens = 40
    hf = make_hf_model(family, tmp_path / "model", vocab=VOCAB, seed=SEEDS[family])
    prompts = prompts_1_to_250(16, seed=1, vocab=VOCAB)
    records = generate_records(tmp_path / "model", tmp_path, prompts, new_tokens)
    for i, (p, r) in enumerate(zip(prompts, records)):
        tokens, logprobs, gap = hf_greedy_logprobs(hf, p, new_tokens)
        assert gap > MIN_GAP, f"{family} prompt {i}: top-2 gap {gap} too small for the comparison to mean anything"
        n = len(r["token_ids"])  # the engine stops at the model's EOS (2); transformers was told not to
        assert r["token_ids"] == tokens[:n], f"{family} prompt {i} (len {len(p)})"
        assert n == new_tokens if r["finish_reason"] == "length" else r["token_ids"][-1] == hf.config.eos_token_id
        np.testing.assert_allclose(r["logprobs"], logprobs[:n], atol=1e-4, rtol=0, err_msg=f"{family} prompt {i}")


BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def test_config_reads_qwen2_moes_shared_expert():
    """Qwen2-MoE: Qwen3-MoE's router and sparse layers, a shared expert (its config class's defaults when absent),
    q/k/v biases unless qkv_bias is false; the released Qwen1.5-MoE writes sliding_window beside use_sliding_window
    false, and transformers saves 0 there: no window either way."""
    qwen2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                 "shared_expert_intermediate_size": 24, "mlp_only_layers": [0],
                                 "use_sliding_window": False, "sliding_window": 0})
    assert (qwen2.moe.num_experts, qwen2.moe.top_k, qwen2.moe.shared_expert_size) == (8, 2, 24)
    assert qwen2.moe.sparse_layers == (False, True, True, True) and qwen2.qkv_bias and qwen2.sliding_window is None
    defaults = ModelConfig.from_hf({**BASE, "model_type": "qwen2_moe", "qkv_bias": False})
    assert (defaults.moe.num_experts, defaults.moe.top_k, defaults.moe.expert_size,
            defaults.moe.shared_expert_size) == (60, 4, 1408, 5632) and not defaults.qkv_bias
    assert ModelConfig.from_hf({**BASE, "model_type": "qwen3_moe"}).moe.shared_expert_size == 0
    with pytest.raises(UnsupportedModelError, match="sliding_window=0"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2_moe", "sliding_window": 0})


def test_config_reads_each_familys_router_and_sparse_layers():
    mixtral = ModelConfig.from_hf({**BASE, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.renormalize) == (8, 2, True)
    assert mixtral.moe.sparse_layers == (True,) * 4 and mixtral.moe.expert_size == 8
    qwen = ModelConfig.from_hf({**BASE, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 3,
                                "moe_intermediate_size": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.renormalize, qwen.moe.expert_size) == (6, 3, False, 4)
    assert qwen.moe.sparse_layers == (False, True, False, False) and qwen.qk_norm
    assert ModelConfig.from_hf({**BASE, "model_type": "qwen3_moe", "norm_topk_prob": True}).moe.renormalize
    assert ModelConfig.from_hf(BASE | {"model_type": "llama"}).moe is None


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
     r"^config.json num_local_experts=2 and num_experts_per_tok=3: need"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 0}, r"^config.json num_experts=4 and"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, r"^config.json decoder_sparse_step=0"),
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 0},
     r"^config.json shared_expert_intermediate_size=0: must be a whole number from 1"),
])
def test_unsupported_moe_fields_are_refused_in_one_line(hf, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**BASE, **hf})


def test_hub_checkpoints_keep_one_tensor_per_expert(tmp_path):
    """transformers' save_pretrained writes the Hub's layout (experts.{e}.w1/w2/w3), which is what the loader reads."""
    make_hf_model("mixtral", tmp_path)
    names = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "model.safetensors").read_bytes()[:8], "little")])
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "mixtral"


@pytest.mark.parametrize("preset, width", [("tiny-mixtral", 2), ("tiny-qwen3-moe", 4), ("qwen2_moe", 4)])
def test_tensor_parallel_samples_as_one_device(tmp_path, preset, width):
    """The experts spread whole over `model` (expert parallelism): each device holds 8 / width experts at their full
    MLP width, and reads only those; one device's tokens, logprobs within 1e-4 (attention's split output projection
    sums partial products in another order; the experts' outputs are one device's bits)."""
    if preset.startswith("tiny-"):
        path = write_model(preset, tmp_path / "model")
    else:  # transformers' own Qwen2-MoE: its shared expert split over `model` by its width, as the dense MLP
        make_hf_model(preset, tmp_path / "model", vocab=VOCAB)
        path = tmp_path / "model"
    rng = np.random.default_rng(3)
    requests = [Request(f"r{i}", tuple(rng.integers(6, VOCAB, int(n)).tolist()),
                        SamplingConfig(max_new_tokens=12, temperature=t, seed=2, logprobs=True))
                for i, (n, t) in enumerate([(5, 0.0), (40, 0.0), (90, 0.8), (17, 0.8)])]
    config = EngineConfig(page_size=8, max_pages=96, max_seqs=4, max_seq_len=160)
    one = Engine(path, config).generate(requests)
    mesh = Mesh(np.array(jax.devices()[:width]).reshape(1, width), ("data", "model"))
    engine = Engine(path, config, mesh=mesh)
    got = engine.generate(requests)
    sparse = next(layer for layer in engine.runner.model.layers if layer.moe is not None)
    num_experts, _, expert_size = sparse.moe.w_gate.array.shape
    for w in (sparse.moe.w_gate, sparse.moe.w_up, sparse.moe.w_down):
        assert {s.data.shape[0] for s in w.array.addressable_shards} == {num_experts // width}
        assert {s.index[0].start for s in w.array.addressable_shards} == set(range(0, num_experts, num_experts // width))
    assert {s.data.shape[-1] for s in sparse.moe.w_gate.array.addressable_shards} == {expert_size}
    assert {s.data.shape for s in sparse.moe.router.array.addressable_shards} == {sparse.moe.router.array.shape}
    if sparse.moe.shared is not None:
        width_shared = sparse.moe.shared.w_gate.array.shape[-1]
        assert {s.data.shape[-1] for s in sparse.moe.shared.w_gate.array.addressable_shards} == {width_shared // width}
    assert [c.token_ids for c in got] == [c.token_ids for c in one]
    for a, b in zip(got, one):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_a_qwen2_moe_checkpoint_without_its_shared_expert_gate_is_named(tmp_path):
    """The header check knows Qwen2-MoE's shared expert: a checkpoint without its gate is refused naming the tensor,
    before any weight is read."""
    from safetensors.numpy import load_file, save_file

    from engine.models.checkpoint_check import CheckpointError, check_checkpoint

    make_hf_model("qwen2_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.shared_expert_gate.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.shared_expert_gate.weight"):
        check_checkpoint(tmp_path, ModelConfig.from_pretrained(tmp_path))
