"""A model directory's Hugging Face tokenizer, loaded without `AutoTokenizer`'s start-up cost after the
first time.

`AutoTokenizer.from_pretrained` decides the tokenizer class from the directory's files (tokenizer_config,
config's model_type, a table of per-model exceptions) and to do so imports the model's configuration
module, which imports torch when torch is installed (seconds of start-up). The class it picks is a function of the directory's files and the transformers version, so it is remembered
(module and name, keyed by a hash of those) next to the XLA compilation cache (`compile_cache.py`; off
when that is off), and later loads import that class and call its `from_pretrained` directly, as
`AutoTokenizer` itself ends up doing. Anything unexpected falls back to `AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from engine.device import compile_cache
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".npz", ".ckpt")
_MAX_HASHED_BYTES = 64 * 2**20  # tokenizer files are far smaller; anything bigger is not one
# transformers' lazy module is not thread-safe: a first `transformers.AutoTokenizer` in two threads at once raises
# AttributeError in one (the service runs each run's head in a thread). Loads take turns.
_LOADING = threading.Lock()


def has_tokenizer(model_path: str | os.PathLike) -> bool:
    path = Path(model_path)
    return (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()


def load_tokenizer(model_path: str | os.PathLike, **kwargs):
    """The tokenizer `transformers.AutoTokenizer.from_pretrained(model_path, **kwargs)` returns."""
    with _LOADING:
        return _load(Path(model_path), **kwargs)


def _load(path: Path, **kwargs):
    memo = _memo_path(path, kwargs) if path.is_dir() else None
    if memo is not None and memo.exists():
        try:
            known = json.loads(memo.read_text())
            cls = getattr(importlib.import_module(known["module"]), known["name"])
            return cls.from_pretrained(str(path), **kwargs)
        except Exception:  # noqa: BLE001 - a stale or unreadable memo: decide again below
            pass
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), **kwargs)
    cls = type(tokenizer)
    if memo is not None and cls.__module__.startswith("transformers."):
        _write(memo, {"module": cls.__module__, "name": cls.__qualname__})
    return tokenizer


def text_decoder(tokenizer, skip_special_tokens: bool = False) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)`, as cheap as it can be made.

    The stop checker decodes twice per generated token when stop strings are set. For transformers'
    `TokenizersBackend` and its subclasses that override neither `decode` nor `_decode` (the Llama,
    Mistral and Qwen2 tokenizers), without clean-up of spaces, that decode is the Rust tokenizer's own
    behind ~12 us of Python (measured: 14 us a call against 2 us): call the Rust one directly.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        Tokenizer = TokenizersBackend = None
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and isinstance(backend, Tokenizer) and not tokenizer.clean_up_tokenization_spaces
            and type(tokenizer).decode is TokenizersBackend.decode
            and type(tokenizer)._decode is TokenizersBackend._decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def special_token_texts(tokenizer) -> frozenset[str]:
    """The text of every special token (`<|end|>`, `</s>`, ...): what a completion leaves out."""
    texts = set(getattr(tokenizer, "all_special_tokens", ()))
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False):
            texts.add(str(added.content))
    return frozenset(t for t in texts if t)


def _memo_path(path: Path, kwargs: dict) -> Path | None:
    cache = compile_cache.directory()
    if cache is None:
        return None
    try:
        from importlib.metadata import version

        digest = hashlib.sha256(f"transformers {version('transformers')} {sorted(kwargs.items())!r}".encode())
        for f in sorted(path.iterdir()):
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.stat().st_size <= _MAX_HASHED_BYTES:
                digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    except (OSError, ValueError):
        return None
    return Path(cache) / "tokenizers" / f"{digest.hexdigest()[:24]}.json"


def _write(memo: Path, record: dict) -> None:
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=f".{memo.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, memo)
    except OSError:
        pass  # only a speed-up: the next process decides again
