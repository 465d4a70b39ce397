"""Where the model and tokenizer come from; what planning needs of them (never the weights)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import fsspec

import engine as capacity
from engine import EngineConfig

# Files that make up a tokenizer (hashed for the tokenizer fingerprint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


@dataclass(frozen=True)
class ModelSourceConfig:
    path: str | None = None
    """HF-format checkpoint directory (config.json + *.safetensors), local or fsspec URL."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to model.path."""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Parameter and activation dtype; float32 on CPU for exactness."""

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.require_path()

    def require_path(self) -> str:
        if not self.path:
            raise ValueError("model.path is not set: pass --model.path=DIR (an HF-format checkpoint directory, "
                             "e.g. one written by `pagefleet init-model --preset tiny-llama --output DIR`)")
        return self.path


def _read(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def model_config(source: ModelSourceConfig) -> dict:
    """The checkpoint's config.json."""
    url = source.require_path().rstrip("/") + "/config.json"
    try:
        return json.loads(_read(url))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} not found: model.path must be an HF-format checkpoint directory") from None


def max_seq_len(source: ModelSourceConfig, engine: EngineConfig) -> int:
    """Longest sequence (prompt plus completion), by the engine's rule (engine.capacity.max_seq_len)."""
    if engine.max_seq_len is not None:  # no need to read config.json
        return capacity.max_seq_len(engine, None)
    return capacity.max_seq_len(engine, model_config(source).get("max_position_embeddings"), source.path)


def load_tokenizer(source: ModelSourceConfig):
    """The tokenizer as transformers' AutoTokenizer builds it (local directory; never the Hugging Face hub)."""
    from engine import load_tokenizer as load

    return load(source.tokenizer_path, local_files_only=True)


def tokenizer_fingerprint(source: ModelSourceConfig) -> str:
    """sha256 over the tokenizer's files (those of TOKENIZER_FILES that exist), by name."""
    fs, root = fsspec.core.url_to_fs(source.tokenizer_path)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = root.rstrip("/") + "/" + name
        if fs.exists(path):
            digest.update(name.encode() + b"\0" + fs.cat_file(path) + b"\0")
    return digest.hexdigest()


def model_fingerprint(source: ModelSourceConfig) -> str:
    """sha256 of config.json (weights are not read at plan time)."""
    return hashlib.sha256(_read(source.require_path().rstrip("/") + "/config.json")).hexdigest()
