"""The model's architecture, read from a Hugging Face `config.json`; unsupported settings are refused by name.

The ids that end a sample (EOS) are `generation_config.json`'s `eos_token_id` where the checkpoint has that file,
else config.json's, as transformers' `generate` and vLLM read them (an instruct model's end-of-turn token is often
named only there: Gemma 2's `<end_of_turn>`, Qwen's `<|endoftext|>`); the engine adds the tokenizer's EOS."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import engine.files as files
from engine.models.model_family import FamilyConfigError, LayerStyle
from engine.models.model_registry import FAMILIES, model_family
from engine.models.moe_config import MoeConfig

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # one file per family: engine/models/model_registry.py
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GENERATION_CONFIG = "generation_config.json"


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something pagefleet does not implement; the message names the field."""


# The largest value each size field of config.json may take: far above any released model (Llama-3.1-405B has
# 126 layers, 128 heads, 16,384 wide; Gemma 3's vocabulary is 262,144), low enough that nothing sized from them
# (expected tensor shapes, KV pools, rotary tables) is allocated for a typo or a hostile file.
SIZE_LIMITS = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
               "hidden_size": 1 << 18, "intermediate_size": 1 << 21, "vocab_size": 1 << 23, "head_dim": 4096,
               "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26}


def _check_sizes(hf: dict) -> None:
    """Each size field present is an integer from 1 to its limit (one line naming the field), before anything
    is computed or allocated from it."""
    for key, limit in SIZE_LIMITS.items():
        value = hf.get(key)
        if value is None or (key == "sliding_window" and value is False):
            continue
        if key == "sliding_window" and value == 0 and hf.get("use_sliding_window") is False:
            continue  # transformers' Qwen2MoeConfig saves 0 for "no window" when use_sliding_window is false
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise UnsupportedModelError(f"config.json {key}={value!r}: must be a whole number from 1 to {limit:,} "
                                        "(is this the model's own config.json?)")
    for key in ("rms_norm_eps", "rope_theta"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise UnsupportedModelError(f"config.json {key}={value!r}: must be a finite positive number")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear position interpolation (`rope_type: linear`): every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    """The model's context length; None when config.json has none (engine.max_seq_len must say it then)."""
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | LinearRopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    """Tokens a query may look back (inclusive of itself); None means full causal attention."""
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hidden_act: str = "silu"
    """The MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)."""
    style: LayerStyle = LayerStyle()
    """What the family's layer does beyond Llama's (engine/models/model_family.py)."""
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    """Where the checkpoint may keep the tensors instead (ModelFamily.weight_prefixes)."""
    image_token_id: int | None = None
    """A multimodal checkpoint's image placeholder token: the engine runs its text model only, so a prompt holding
    it is refused."""
    moe: MoeConfig | None = None
    """The mixture of experts (engine/models/moe.py); None: a dense MLP of width intermediate_size on every layer."""
    qk_norm: bool = False
    """An RMSNorm (weights `self_attn.q_norm`, `self_attn.k_norm` of head_dim) on each query and key head before RoPE."""

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """The factor on q . k: head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5."""
        return (self.style.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends within `sliding_window` (every layer when the family gives no layer types)."""
        types = self.style.layer_types
        return self.sliding_window is not None and (types is None or types[layer] == "sliding_attention")

    def layer_window(self, layer: int) -> int | None:
        """Tokens layer `layer`'s queries see (their own included); None: the whole context."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's `layer_window`, in order (what the KV pool's layer groups follow, engine/kv/kv_groups.py)."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    def rope_inv_freq(self, sliding: bool = False) -> list[float]:
        """Inverse frequencies (radians per position) of each rotary pair, scaling applied; `sliding`: those of
        the sliding-window layers, which Gemma 3 gives their own base (`style.local_rope_theta`), unscaled."""
        local = self.style.local_rope_theta
        if sliding and local is not None:
            return [1.0 / (local ** (2 * i / self.head_dim)) for i in range(self.head_dim // 2)]
        inv = [1.0 / (self.rope_theta ** (2 * i / self.head_dim)) for i in range(self.head_dim // 2)]
        s = self.rope_scaling
        if s is None:
            return inv
        if isinstance(s, LinearRopeScaling):
            return [f / s.factor for f in inv]
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / s.factor)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        root = path if files.is_url(path) else Path(path)
        config_path, generation_path = files.join(root, "config.json"), files.join(root, GENERATION_CONFIG)
        if not files.exists(config_path):
            raise FileNotFoundError(f"{config_path} not found: model.path must be a Hugging Face checkpoint directory")
        generation = (parse_generation_config(files.read_bytes(generation_path), str(generation_path))
                      if files.exists(generation_path) else None)
        return cls.from_hf(json.loads(files.read_text(config_path)), generation)

    @classmethod
    def from_hf(cls, hf: dict, generation: dict | None = None) -> "ModelConfig":
        """`hf`: config.json; `generation`: generation_config.json where the checkpoint has one (its EOS ids win)."""
        model_type = hf.get("model_type")
        family = model_family(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"config.json model_type={model_type!r} is not supported; pagefleet runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hf = family.text_config(hf)  # a multimodal checkpoint's text model; transformers' defaults filled in
        except FamilyConfigError as e:
            raise UnsupportedModelError(str(e)) from None
        act = family.activation(hf)
        if act not in SUPPORTED_ACTIVATIONS:
            field = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
            raise UnsupportedModelError(f"config.json {field}={act!r} is not supported for model_type={model_type}; "
                                        f"pagefleet runs {', '.join(SUPPORTED_ACTIVATIONS)}")
        if hf.get("mlp_bias", False):
            raise UnsupportedModelError("config.json mlp_bias=true is not supported")
        missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
                               "vocab_size") if k not in hf]
        if missing:
            raise UnsupportedModelError(f"config.json has no {', '.join(missing)}; a Llama-family checkpoint's "
                                        "config.json names them (is this the model's own config.json?)")
        _check_sizes(hf)
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"config.json num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if head_dim < 1:
            raise UnsupportedModelError(f"config.json hidden_size={hf['hidden_size']} is smaller than "
                                        f"num_attention_heads={num_heads}, and there is no head_dim")
        # transformers 5 writes `rope_parameters` (with rope_theta inside); released checkpoints
        # carry top-level `rope_theta` and `rope_scaling`. Accept both.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"config.json rope_scaling.rope_type={rope_type!r} is not supported; pagefleet runs "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "linear":
            scaling = LinearRopeScaling(factor=float(rope["factor"]))
        try:
            attention = family.attention(hf)  # what the family sets in the shared layers
            style = family.style(hf)
            moe = family.moe(hf)
        except FamilyConfigError as e:
            raise UnsupportedModelError(str(e)) from None
        qkv_bias, window = attention.qkv_bias, attention.sliding_window
        eos_ids = (eos_token_ids(hf, "config.json") if generation is None
                   else eos_token_ids(generation, GENERATION_CONFIG))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            hidden_act=act,
            style=style,
            weight_prefixes=family.weight_prefixes,
            image_token_id=hf.get("image_token_index"),
            qk_norm=attention.qk_norm,
            moe=moe,
        )


def parse_generation_config(data: bytes, where: str) -> dict:
    """generation_config.json's fields; one line naming the file and the fix when it is not a JSON object."""
    fix = "fix it, or remove it to end samples at config.json's eos_token_id"
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{where} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise UnsupportedModelError(f"{where} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


def eos_token_ids(fields: dict, name: str) -> tuple[int, ...]:
    """`eos_token_id` of config.json or generation_config.json (`name`): none, one id or a list of them."""
    value = fields.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise UnsupportedModelError(f"{name} eos_token_id={value!r}: must be a token id or a list of token ids")
    return tuple(ids)
