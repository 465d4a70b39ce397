"""Where pagefleet's files live: a local path or a URL (`gs://bucket/key`, `memory://...`), one API for both,
used by the engine (checkpoints, read by byte ranges) and the orchestrator (the run directory, corpora).

gcsfs (fsspec) does the reads, listings and uploads of URLs; local paths go straight to the operating system.
Writes that must be all or nothing are `orchestrator.storage.atomic`'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import tenacity
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem

OBJECT_STORES = ("gs", "gcs")
"""Protocols whose writes are whole-object and atomic, with generation preconditions."""
ATTEMPTS = 5
"""Tries per ranged read (exponential backoff between them) before it fails naming the object."""


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


def filesystem(path: str | os.PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, path within it), for reads here and for libraries that take one (pyarrow, Ray Data).

    No listing cache on an object store: another process (a head, a slice, `status` on a laptop) may have changed
    the bucket since this process last looked, and a stale "absent" would be wrong."""
    path = str(path)
    return url_to_fs(path, use_listings_cache=False) if is_object_store(path) else url_to_fs(path)


def exists(path: str | os.PathLike) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = filesystem(path)
    return fs.exists(p)


def file_size(path: str | os.PathLike) -> int:
    """Bytes in the file or object; FileNotFoundError when there is none."""
    if not is_url(path):
        return Path(path).stat().st_size
    fs, p = filesystem(path)
    return int(fs.size(p))


@tenacity.retry(stop=tenacity.stop_after_attempt(ATTEMPTS), wait=tenacity.wait_exponential(multiplier=0.2, max=5),
                retry=tenacity.retry_if_not_exception_type((FileNotFoundError, PermissionError)), reraise=True)
def read_range(path: str | os.PathLike, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file or object (fewer only past its end); an object store request is retried."""
    if not is_url(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, p = filesystem(path)
    return fs.cat_file(p, start=start, end=end)


def read_bytes(path: str | os.PathLike) -> bytes:
    if not is_url(path):
        return Path(path).read_bytes()
    fs, p = filesystem(path)
    return fs.cat_file(p)


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode("utf-8")


def upload_file(local: str | os.PathLike, url: str) -> None:
    """Copy a local file to `url` as one object. A single or resumable upload makes the object visible only once it
    is complete."""
    fs, p = filesystem(url)
    fs.put_file(str(local), p)


def list_names(directory: str | os.PathLike, suffix: str = "") -> list[str]:
    """Names (not paths) of the files directly in `directory` ending in `suffix`, sorted; [] if it is absent."""
    if not is_url(directory):
        if not os.path.isdir(directory):
            return []
        return sorted(n for n in os.listdir(directory) if n.endswith(suffix) and os.path.isfile(os.path.join(directory, n)))
    fs, p = filesystem(directory)
    try:
        entries = fs.ls(p, detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e["type"] == "file" and e["name"].endswith(suffix))


def list_sizes(directory: str | os.PathLike, suffix: str = "") -> dict[str, int]:
    """{name: bytes} of the files directly in `directory` ending in `suffix`, from one listing (paged on an object
    store); {} if it is absent."""
    if not is_url(directory):
        try:
            with os.scandir(directory) as entries:
                return {e.name: e.stat().st_size for e in entries if e.name.endswith(suffix) and e.is_file()}
        except FileNotFoundError:
            return {}
    fs, p = filesystem(directory)
    try:
        entries = fs.ls(p, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rsplit("/", 1)[-1]: int(e["size"]) for e in entries
            if e["type"] == "file" and e["name"].endswith(suffix)}


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory (locally) or every object under a prefix (object store)."""
    if not is_url(path):
        shutil.rmtree(path)
        return
    fs, p = filesystem(path)
    fs.rm(p, recursive=True)


def makedirs(directory: str | os.PathLike) -> None:
    """Make a local directory (and its parents); object stores have no directories, so nothing to do there."""
    if not is_url(directory):
        os.makedirs(directory, exist_ok=True)


def remove(path: str | os.PathLike, missing_ok: bool = True) -> None:
    if not is_url(path):
        Path(path).unlink(missing_ok=missing_ok)
        return
    fs, p = filesystem(path)
    try:
        fs.rm_file(p)
    except FileNotFoundError:
        if not missing_ok:
            raise


def open_file(path: str | os.PathLike, mode: str = "rb"):
    """A file object for reading (`rb`), local or remote (ranged reads on an object store)."""
    if not is_url(path):
        return open(path, mode)
    fs, p = filesystem(path)
    return fs.open(p, mode)
