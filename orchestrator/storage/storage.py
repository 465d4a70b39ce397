"""Where pagefleet's files live: a local path or an object store URL (`gs://bucket/key`), one API for both.

Every read and write of durable state goes through here, so the two kinds of storage keep the same
guarantees:

- `write_atomic`: all or nothing. Locally a temporary file, fsync, then rename (atomic.py); on an
  object store one whole-object upload, which Cloud Storage makes visible all at once or not at all
  (no temporary object, no rename: a rename there is a copy and a delete).

gcsfs (fsspec) does the plain reads, listings and writes here. The rest of the storage layer, one concept
a module: compare-and-swap on object generations (generations.py), a pathlib-like view of an object
(location.py), appending to an object (object_append.py), parquet reads by ranged requests (parquet_io.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem

from orchestrator.storage.atomic import atomic_write_bytes

OBJECT_STORES = ("gs", "gcs")
"""Protocols whose writes are whole-object and atomic, with generation preconditions."""


def is_url(path: str | os.PathLike) -> bool:
    """A protocol-qualified location (`gs://...`, `memory://...`), as opposed to a local path."""
    return split_protocol(str(path))[0] is not None


def local_path(path: str | os.PathLike) -> str | None:
    """The absolute local path fsspec opens for `path`, or None when fsspec reads it from elsewhere.

    fsspec reads `file:/x`, `local:/x`, `file:~/x` and `file:///x` from the local file system although
    `split_protocol` sees no protocol in the first three; a check of what a path may read must resolve it the way
    the opener does, so both go through `url_to_fs`. Relative paths resolve against the working directory.
    A `::` chain (a cache in front of another file system) is not local."""
    text = str(path)
    if "::" in text:
        return None
    fs, stripped = url_to_fs(text)
    return stripped if isinstance(fs, LocalFileSystem) else None


def is_object_store(path: str | os.PathLike) -> bool:
    return split_protocol(str(path))[0] in OBJECT_STORES


def join(root: str | os.PathLike, *parts: str) -> str:
    """`root/part/...` for a local path or a URL (a URL keeps its `//`)."""
    if is_url(root):
        return "/".join([str(root).rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(root, *parts))


def _fs(path: str):
    # No listing cache: another process (a head, a slice, `status` on a laptop) may have changed the
    # bucket since this process last looked, and a stale "absent" would be wrong.
    return url_to_fs(path, use_listings_cache=False) if is_object_store(path) else url_to_fs(path)


def exists(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(str(path))
    return fs.exists(p)


def read_bytes(path: str | os.PathLike) -> bytes:
    if not is_url(path):
        return Path(path).read_bytes()
    fs, p = _fs(str(path))
    return fs.cat_file(p)


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode("utf-8")


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data`, all or nothing (see the module docstring)."""
    if not is_url(path):
        atomic_write_bytes(path, data)
        return
    fs, p = _fs(str(path))
    fs.pipe_file(p, data)


def upload_file(local: str | os.PathLike, url: str) -> None:
    """Copy a local file to `url` as one object. Atomic like `write_atomic`: a single or resumable upload
    makes the object visible only once it is complete."""
    fs, p = _fs(url)
    fs.put_file(str(local), p)


def list_names(directory: str | os.PathLike, suffix: str = "") -> list[str]:
    """Names (not paths) of the files directly in `directory` ending in `suffix`, sorted; [] if it is absent."""
    if not is_url(directory):
        if not os.path.isdir(directory):
            return []
        return sorted(n for n in os.listdir(directory) if n.endswith(suffix) and os.path.isfile(os.path.join(directory, n)))
    fs, p = _fs(str(directory))
    try:
        entries = fs.ls(p, detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e["type"] == "file" and e["name"].endswith(suffix))


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory (locally) or every object under a prefix (object store)."""
    if not is_url(path):
        import shutil

        shutil.rmtree(path)
        return
    fs, p = _fs(str(path))
    fs.rm(p, recursive=True)


def makedirs(directory: str | os.PathLike) -> None:
    """Make a local directory (and its parents); object stores have no directories, so nothing to do there."""
    if not is_url(directory):
        os.makedirs(directory, exist_ok=True)


def remove(path: str | os.PathLike, missing_ok: bool = True) -> None:
    if not is_url(path):
        Path(path).unlink(missing_ok=missing_ok)
        return
    fs, p = _fs(str(path))
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        if not missing_ok:
            raise


def open_file(path: str | os.PathLike, mode: str = "rb"):
    """A file object for reading (`rb`), local or remote (ranged reads on an object store)."""
    if not is_url(path):
        return open(path, mode)
    fs, p = _fs(str(path))
    return fs.open(p, mode)


def filesystem(path: str | os.PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for libraries that take one (pyarrow, Ray Data)."""
    return _fs(str(path))
