"""A checkpoint or tokenizer on an object store (`gs://...`), copied once per host into a local cache directory.

The engine memory-maps safetensors files and transformers reads tokenizer files from a directory, so a
`gs://` model is first copied here, whole, and then loaded exactly as a local one (the same bytes, so
the same parameters and samples). The copy is keyed by the URL and checked against each object's
generation (or etag) and size: a second load on the same host reads nothing from the bucket, and a
checkpoint replaced in the bucket is copied again. A copy is made in a temporary directory and
renamed into place, so a crash mid-download never leaves a partial checkpoint that looks complete.

This copy is the optional cache (`model.cache_dir`). Without it, the engine reads a gs:// checkpoint straight
from the bucket, each host only its own devices' shards (engine/ranged_file.py); the tokenizer, which
transformers reads from a directory, is always copied (its files only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

from orchestrator.storage import storage



def default_cache_dir() -> str:
    """Where copies go without `model.cache_dir`: `$XDG_CACHE_HOME/pagefleet/models`, else ~/.cache/..."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagefleet", "models")

_SOURCE = ".pagefleet-source.json"  # what the copy was made from: url and each file's version


@dataclass(frozen=True)
class Fetch:
    """What making a checkpoint local cost: bytes read from the store (0 on a cache hit) and seconds."""

    local_path: str
    bytes_read: int = 0
    seconds: float = 0.0
    cached: bool = False


def _versions(url: str, names: Iterable[str] | None) -> dict[str, list]:
    fs, root = storage.filesystem(url)
    wanted = None if names is None else set(names)
    out = {}
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    for entry in entries:
        name = entry["name"].rsplit("/", 1)[-1]
        if entry["type"] != "file" or (wanted is not None and name not in wanted):
            continue
        out[name] = [entry.get("size"), entry.get("generation") or entry.get("etag") or entry.get("mtime")]
    return {k: [v[0], str(v[1])] for k, v in sorted(out.items())}


def _holds(target: str, source: dict) -> bool:
    try:
        with open(os.path.join(target, _SOURCE)) as f:
            return json.load(f) == source
    except (OSError, ValueError):
        return False


def local_copy(path: str, cache_dir: str | None = None, names: Iterable[str] | None = None) -> Fetch:
    """`path` itself when it is local; for a URL, a local directory holding its files (all, or `names`).

    `names` limits the copy to those files (a tokenizer's, say); a copy of another selection of the same
    URL is a separate cache entry. Raises FileNotFoundError naming the URL when it holds no files.
    """
    if not storage.is_url(path):
        return Fetch(local_path=path)
    t0 = time.perf_counter()
    url = path.rstrip("/")
    versions = _versions(url, names)
    if not versions:
        raise FileNotFoundError(f"{url} holds no files: model.path / model.tokenizer must be a checkpoint "
                                "directory (config.json, *.safetensors, tokenizer files)")
    key = hashlib.sha256(json.dumps([url, None if names is None else sorted(names)]).encode()).hexdigest()[:24]
    root = os.path.abspath(cache_dir or default_cache_dir())
    target = os.path.join(root, key)
    source = {"url": url, "files": versions}
    if _holds(target, source):
        return Fetch(target, 0, time.perf_counter() - t0, cached=True)
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=root)
    try:
        fs, base = storage.filesystem(url)
        fs.get([f"{base}/{n}" for n in versions], [os.path.join(tmp, n) for n in versions])  # concurrent
        with open(os.path.join(tmp, _SOURCE), "w") as f:
            json.dump(source, f)
        old = tempfile.mkdtemp(prefix=f".{key}.old.", dir=root)
        try:
            if os.path.exists(target):  # an outdated copy: move it aside, then put the new one in its place
                os.replace(target, os.path.join(old, "x"))
            os.replace(tmp, target)
        except OSError:
            if not _holds(target, source):
                raise
            shutil.rmtree(tmp)  # another process on this host made the same copy first: use that one
        finally:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    read = sum(int(size or 0) for size, _ in versions.values())
    return Fetch(target, read, time.perf_counter() - t0)
