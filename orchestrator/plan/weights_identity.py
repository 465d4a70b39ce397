"""The identity of a checkpoint's weight files: recorded in run.json at plan time, checked on every resume and on
every slice load, so that weights changed in place are refused instead of mixed into one export.

Per file (every `*.safetensors` and `model.safetensors.index.json` of the checkpoint directory):

- `size` in bytes and `header_sha256`, sha256 over the safetensors header (its 8-byte length and the JSON that
  names every tensor's dtype, shape and byte range; the index file's whole text): one small ranged read a file,
  cheap on gs:// at any checkpoint size;
- `version`: the object's generation on gs://, the modification time locally; any rewrite changes it;
- `sha256` of the whole content, only when the checkpoint is at most CONTENT_HASH_LIMIT_BYTES in all (hashed
  once, at plan time).

A check compares sizes and headers always. A file whose version is unchanged is the same file. A file whose
version changed (rewritten, touched, copied without keeping times) is re-hashed when a content hash was recorded
and accepted only when it matches; without one (a large checkpoint) it is refused: re-hashing terabytes at every
resume is not cheap, and an edit of the same size and header is otherwise invisible.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import fsspec

from orchestrator.state.rundir import PlanMismatch

CONTENT_HASH_LIMIT_BYTES = 4 * 2**30
"""Checkpoints up to this size (all weight files together) get a content hash per file at plan time."""
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header
_CHUNK_BYTES = 8 * 2**20
INDEX_FILE = "model.safetensors.index.json"


class WeightsChanged(PlanMismatch):
    """A weight file differs from the one the run was planned with; the message names it and the fix."""


def _fs(model_path: str) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(model_path)
    return fs, root.rstrip("/")


def _names(fs, root: str) -> list[str]:
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    return sorted(n for n in names if n.endswith(".safetensors") or n == INDEX_FILE)


def _header_sha256(fs, path: str, name: str, size: int) -> str:
    with fs.open(path, "rb") as f:
        if name == INDEX_FILE:
            return hashlib.sha256(f.read()).hexdigest()
        head = f.read(8)
        if len(head) < 8:
            return hashlib.sha256(head).hexdigest()
        length = struct.unpack("<Q", head)[0]
        body = f.read(length) if length <= min(_MAX_HEADER_BYTES, size - 8) else b""  # else not safetensors: size only
    return hashlib.sha256(head + body).hexdigest()


def _version(info: dict) -> str | None:
    for key in ("generation", "mtime", "LastModified", "updated"):
        if info.get(key) is not None:
            return str(info[key])
    return None


def content_sha256(fs, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(fs, root: str, name: str) -> dict[str, Any]:
    path = f"{root}/{name}"
    info = fs.info(path)
    size = int(info["size"])
    return {"size": size, "header_sha256": _header_sha256(fs, path, name, size), "version": _version(info)}


def weights_identity(model_path: str, content_limit_bytes: int = CONTENT_HASH_LIMIT_BYTES) -> dict[str, dict]:
    """{file name: {size, header_sha256, version[, sha256]}} for the checkpoint's weight files (see module doc)."""
    fs, root = _fs(model_path)
    files = {name: _identity(fs, root, name) for name in _names(fs, root)}
    if sum(f["size"] for f in files.values()) <= content_limit_bytes:
        for name, f in files.items():
            f["sha256"] = content_sha256(fs, f"{root}/{name}")
    return files


def weights_digest(identity: dict[str, dict]) -> str:
    """The weights' fingerprint for run.json's `fingerprints`: sizes, headers and content hashes, not versions (a
    copy of the same bytes is the same model)."""
    stable = {name: {k: v for k, v in f.items() if k != "version"} for name, f in identity.items()}
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()


def check_weights(model_path: str, recorded: dict[str, dict]) -> None:
    """Raise WeightsChanged, in one line naming the file, when the checkpoint's weight files are not the recorded
    ones (see module doc for what is compared)."""
    fs, root = _fs(model_path)
    names = _names(fs, root)
    fix = ("restore the checkpoint the run was planned with, or start a new run for these weights with --name=NAME "
           "(or --run_dir=DIR)")
    for name in sorted(set(recorded) ^ set(names)):
        what = "is new" if name in names else "is gone"
        raise WeightsChanged(f"weight file {root}/{name} {what} since the run was planned; {fix}")
    for name in names:
        old = recorded[name]
        path = f"{root}/{name}"
        now = _identity(fs, root, name)
        if now["size"] != old.get("size"):
            raise WeightsChanged(f"weight file {path} changed since the run was planned ({old.get('size')} bytes then, "
                                 f"{now['size']} now); {fix}")
        if now["header_sha256"] != old.get("header_sha256"):
            raise WeightsChanged(f"weight file {path} changed since the run was planned (its tensor header differs); "
                                 f"{fix}")
        if now["version"] == old.get("version"):
            continue
        if "sha256" not in old:
            raise WeightsChanged(f"weight file {path} was rewritten since the run was planned (its modification time "
                                 f"or generation differs) and is too large to re-hash on every resume; {fix}")
        if content_sha256(fs, path) != old["sha256"]:
            raise WeightsChanged(f"weight file {path} changed since the run was planned (same size and header, "
                                 f"different content); {fix}")
