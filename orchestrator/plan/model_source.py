"""Where the model and tokenizer come from; what planning needs of them (never the weights)."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import fsspec

import engine as capacity
from engine import EngineConfig, load_tokenizer as load, model_family
from orchestrator.plan.model_cache import local_copy
from orchestrator.storage.readable import reading
from orchestrator.surface import setting

# Files that make up a tokenizer (hashed for the tokenizer fingerprint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


@dataclass(frozen=True)
class ModelSourceConfig:
    path: str | None = None
    """HF-format checkpoint directory (config.json + *.safetensors), local or fsspec URL, or a Hugging Face
    Hub id (`org/name`) already in the local Hub cache (never downloaded; see docs/models.md)."""
    tokenizer: str | None = None
    """Tokenizer directory (or Hub id in the local cache); defaults to model.path."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter and activation dtype; float32 on CPU for exactness. The engine's dtypes (engine.DTYPES): any
    other is refused when the config loads, before any slice starts."""
    cache_dir: str | None = None
    """Unset: each host reads a gs:// checkpoint straight from the bucket, only its own devices' shards (ranged
    reads), at every load. Set: each host copies the gs:// checkpoint here once and loads the copy (a later load
    with the same objects reads nothing from the bucket). A gs:// tokenizer's files are copied here either way
    (default $XDG_CACHE_HOME/pagefleet/models, else ~/.cache/pagefleet/models)."""

    @property
    def tokenizer_path(self) -> str:
        return resolve_model(self.tokenizer, "model.tokenizer") if self.tokenizer else self.require_path()

    @property
    def tokenizer_key(self) -> str:
        """The setting that names the tokenizer's directory."""
        return "model.tokenizer" if self.tokenizer else "model.path"

    def require_path(self) -> str:
        """The checkpoint's location: a local directory (checked), an fsspec URL, or a cached Hub id's snapshot."""
        if not self.path:
            raise ValueError(f"model.path is not set: pass {setting('model.path', 'DIR')} (an HF-format checkpoint directory, "
                             "e.g. one written by `pagefleet init-model --preset tiny-llama --output DIR`)")
        return resolve_model(self.path, "model.path")


# A Hugging Face Hub repository id: `name` or `org/name` (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def hub_cache_dir() -> str:
    """The local Hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (read at each call, so a changed environment is seen)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface", "hub")


def resolve_model(path: str, key: str = "model.path") -> str:
    """`path` as a directory the engine and tokenizer can read, or FileNotFoundError in one line naming `key`.

    An fsspec URL (`gs://...`) is returned as is. A path that exists locally is used as is; otherwise a
    Hub id (`org/name`) resolves to its snapshot in the local Hub cache (the `main` revision), offline:
    pagefleet never downloads, so it behaves the same with or without HF_HUB_OFFLINE."""
    if "://" in path:
        return path
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and key in ("model.path", "--model"):
            raise FileNotFoundError(f"{key} {path!r} has no config.json: it must be a Hugging Face checkpoint "
                                    "directory (config.json, *.safetensors, tokenizer files)")
        return str(local)
    if local.exists():
        raise FileNotFoundError(f"{key} {path!r} is a file; it must be a Hugging Face checkpoint directory")
    if not _HUB_ID.match(path) or path.startswith((".", "~")):
        raise FileNotFoundError(f"{key} {path!r} does not exist (a local checkpoint directory, or a Hugging Face "
                                "Hub id such as org/name in the local Hub cache)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return str(snapshot_download(path, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        parent = local.parent
        if str(parent) not in ("", ".") and parent.is_dir():  # a path into an existing directory: a typo, not a Hub id
            near = difflib.get_close_matches(local.name, sorted(p.name for p in parent.iterdir() if p.is_dir()), n=1)
            hint = (f"did you mean {str(parent / near[0])!r}?" if near else
                    f"write a model there with `pagefleet init-model --preset tiny-llama --output {path}`")
            raise FileNotFoundError(f"{key} {path!r} does not exist: {parent} has no directory {local.name!r}; "
                                    f"{hint}") from None
        raise FileNotFoundError(
            f"{key} {path!r} is not a local directory, and the Hub id {path!r} is not in the local Hub cache "
            f"({cache}); pagefleet never downloads: fetch it first (`hf download {path}`) or give a directory"
        ) from None


def _read(url: str) -> bytes:
    """A file of the model's directory (model.path)."""
    with reading("model.path", url), fsspec.open(url, "rb") as f:
        return f.read()


def model_config(source: ModelSourceConfig) -> dict:
    """The checkpoint's config.json."""
    url = source.require_path().rstrip("/") + "/config.json"
    try:
        return json.loads(_read(url))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} not found: model.path must be an HF-format checkpoint directory") from None


def generation_config(source: ModelSourceConfig) -> dict | None:
    """The checkpoint's generation_config.json (its eos_token_id ends samples: engine/models/model_config.py); None
    where it has none."""
    url = source.require_path().rstrip("/") + "/" + capacity.GENERATION_CONFIG
    try:
        return capacity.parse_generation_config(_read(url), url)
    except FileNotFoundError:
        return None


def decoder_config(source: ModelSourceConfig) -> dict:
    """config.json's decoder fields: a multimodal checkpoint's `text_config`, transformers' defaults filled in
    where the family's config class has them (the family's `text_config`)."""
    hf = model_config(source)
    family = model_family(hf.get("model_type"))
    return hf if family is None else family.text_config(hf)


def kv_groups(source: ModelSourceConfig, engine: EngineConfig) -> capacity.KVGroups:
    """The KV layer groups the engine runs the model with (engine.kv_groups): from config.json's layer windows. A
    config.json without the model's shape (a plan made from a tokenizer's directory) counts one table, which never
    counts too few pages; the run itself refuses such a model at the head (slice_layout.validate)."""
    try:
        layers = capacity.ModelConfig.from_hf(model_config(source)).layer_windows()
    except capacity.UnsupportedModelError:
        return capacity.KVGroups.single(1)
    return capacity.KVGroups.for_engine(layers, engine.kv_groups, engine.host_kv_pages)


def max_seq_len(source: ModelSourceConfig, engine: EngineConfig) -> int:
    """Longest sequence (prompt plus completion), by the engine's rule (engine.capacity.max_seq_len)."""
    if engine.max_seq_len is not None:  # no need to read config.json
        return capacity.max_seq_len(engine, None)
    return capacity.max_seq_len(engine, decoder_config(source).get("max_position_embeddings"), source.path)


def load_tokenizer(source: ModelSourceConfig):
    """The tokenizer as transformers' AutoTokenizer builds it (local directory; never the Hugging Face hub)."""
    # A gs:// tokenizer: only its own files (and config.json) are copied, never the weights.
    with reading(source.tokenizer_key, source.tokenizer_path, only_under=True):  # not the local copy's cache
        path = local_copy(source.tokenizer_path, source.cache_dir, names=(*TOKENIZER_FILES, "config.json")).local_path
        return load(path, local_files_only=True)


def tokenizer_fingerprint(source: ModelSourceConfig) -> str:
    """sha256 over the tokenizer's files (those of TOKENIZER_FILES that exist), by name."""
    fs, root = fsspec.core.url_to_fs(source.tokenizer_path)
    digest = hashlib.sha256()
    with reading(source.tokenizer_key, source.tokenizer_path):
        for name in TOKENIZER_FILES:
            path = root.rstrip("/") + "/" + name
            if fs.exists(path):
                digest.update(name.encode() + b"\0" + fs.cat_file(path) + b"\0")
    return digest.hexdigest()


def model_fingerprint(source: ModelSourceConfig) -> str:
    """sha256 of config.json (weights are not read at plan time), and of the EOS ids where generation_config.json
    names other ones than config.json (they end samples; where the two agree, a run planned before pagefleet read
    generation_config.json keeps its fingerprint, and resumes)."""
    config = _read(source.require_path().rstrip("/") + "/config.json")
    generation = generation_config(source)
    eos = None if generation is None else capacity.eos_token_ids(generation, capacity.GENERATION_CONFIG)
    if eos is None or set(eos) == set(capacity.eos_token_ids(json.loads(config), "config.json")):
        return hashlib.sha256(config).hexdigest()
    return hashlib.sha256(config + b"\0eos_token_ids:" + json.dumps(sorted(eos)).encode()).hexdigest()
