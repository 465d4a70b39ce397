"""Where pagefleet's files live: a local path or an object store URL (`gs://bucket/key`), one API for both.

Every read and write of durable state goes through here, so the two kinds of storage keep the same
guarantees:

- `write_atomic`: all or nothing. Locally a temporary file, fsync, then rename (atomic.py); on an
  object store one whole-object upload, which Cloud Storage makes visible all at once or not at all
  (no temporary object, no rename: a rename there is a copy and a delete).
- `create_if_absent` / `replace_if_generation`: compare-and-swap on an object's generation (Cloud
  Storage's `ifGenerationMatch` precondition; 0 means "no live object"), for the run directory's
  lock and manifest. A lost race raises `PreconditionFailed` naming the object; nothing is written.

gcsfs (fsspec) does the plain reads, listings and writes. Its `pipe_file(mode="create")` sends
`ifGenerationMatch=0` but nothing takes another generation, and its upload does not return the
generation written, so the conditional writes use google-cloud-storage (a dependency of gcsfs):
`Blob.upload_from_string(..., if_generation_match=G)` sends `ifGenerationMatch=G` and sets
`Blob.generation` from the response. Both clients honour `STORAGE_EMULATOR_HOST`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.core import split_protocol, url_to_fs

from orchestrator.atomic import atomic_write_bytes

OBJECT_STORES = ("gs", "gcs")
"""Protocols whose writes are whole-object and atomic, with generation preconditions."""


class PreconditionFailed(RuntimeError):
    """A conditional write lost its race: the object is not at the generation the writer expected."""


def is_url(path: str | os.PathLike) -> bool:
    """A protocol-qualified location (`gs://...`, `memory://...`), as opposed to a local path."""
    return split_protocol(str(path))[0] is not None


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


# -- compare-and-swap on object generations ---------------------------------------------------------

@functools.cache
def _client(emulator: str | None):
    from google.cloud import storage

    return storage.Client()  # on the emulator: anonymous credentials and a placeholder project


def _blob(url: str):
    if not is_object_store(url):
        raise ValueError(f"{url} is not an object store URL (gs://BUCKET/KEY); generations exist only there")
    bucket, _, key = split_protocol(url)[1].partition("/")
    return _client(os.environ.get("STORAGE_EMULATOR_HOST")).bucket(bucket).blob(key)


def _conditional(url: str, expect: str, do: Callable[[Any], Any]):
    from google.api_core.exceptions import NotFound
    from google.api_core.exceptions import PreconditionFailed as _Precondition

    blob = _blob(url)
    try:
        do(blob)
    except (_Precondition, NotFound):
        raise PreconditionFailed(f"{url} changed under this writer (expected {expect}); another process wrote it") \
            from None
    return blob


def read_with_generation(url: str) -> tuple[bytes, int] | None:
    """The object's bytes and the generation they belong to (one request), or None if it does not exist."""
    from google.api_core.exceptions import NotFound

    blob = _blob(url)
    try:
        data = blob.download_as_bytes()
    except NotFound:
        return None
    return data, int(blob.generation)


def object_info(url: str) -> dict[str, Any] | None:
    """`generation` (int) and `updated` (seconds since the epoch, the store's clock) of an object, or None."""
    from google.api_core.exceptions import NotFound

    blob = _blob(url)
    try:
        blob.reload()
    except NotFound:
        return None
    return {"generation": int(blob.generation), "updated": blob.updated.timestamp()}


def create_if_absent(url: str, data: bytes) -> int:
    """Write `url` only if no object is there (ifGenerationMatch=0); returns the new generation."""
    blob = _conditional(url, "no object", lambda b: b.upload_from_string(data, if_generation_match=0))
    return int(blob.generation)


def replace_if_generation(url: str, data: bytes, generation: int) -> int:
    """Replace `url` only if it is still at `generation`; returns the new generation."""
    blob = _conditional(url, f"generation {generation}",
                        lambda b: b.upload_from_string(data, if_generation_match=generation))
    return int(blob.generation)


def delete_if_generation(url: str, generation: int) -> None:
    """Delete `url` only if it is still at `generation`."""
    _conditional(url, f"generation {generation}", lambda b: b.delete(if_generation_match=generation))


# -- a path on an object store, for code written against pathlib ------------------------------------

class Location:
    """A `gs://` object or prefix with the few `pathlib.Path` methods the run directory's readers use.

    `location(path)` gives a `Path` for a local path and one of these for a URL, so code such as
    `run_dir.manifest.exists()` or `run_dir.root / r.output` reads either kind of run directory.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __truediv__(self, part: str) -> Location:
        return Location(join(self.url, str(part)))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: Location) -> bool:
        return self.url < other.url

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def suffix(self) -> str:
        return "." + self.name.rsplit(".", 1)[1] if "." in self.name else ""

    @property
    def parent(self) -> Location:
        return Location(self.url.rsplit("/", 1)[0])

    def exists(self) -> bool:
        return exists(self.url)

    def is_file(self) -> bool:
        return exists(self.url)

    def is_dir(self) -> bool:
        """Whether any object lies under this prefix."""
        fs, p = _fs(self.url)
        return fs.isdir(p)

    def read_bytes(self) -> bytes:
        return read_bytes(self.url)

    def read_text(self, encoding: str = "utf-8") -> str:
        return read_bytes(self.url).decode(encoding)

    def glob(self, pattern: str) -> list[Location]:
        """Files directly under this prefix matching `*SUFFIX` (the only patterns the run directory uses)."""
        if not pattern.startswith("*") or any(c in pattern[1:] for c in "*?["):
            raise ValueError(f"Location.glob supports '*SUFFIX' only, not {pattern!r}")
        return [self / n for n in list_names(self.url, pattern[1:])]

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: an object store has no directories."""

    def unlink(self, missing_ok: bool = False) -> None:
        remove(self.url, missing_ok=missing_ok)


def location(path: str | os.PathLike) -> Path | Location:
    """`Path(path)` for a local path, a `Location` for a URL."""
    if isinstance(path, Location):
        return path
    return Location(str(path)) if is_url(path) else Path(path)


def parquet_source(path: Path | Location):
    """What pyarrow.parquet reads: the local path itself, or a seekable file object over the object (the
    caller closes it) whose footer and column chunks are fetched with ranged reads."""
    return open_file(str(path), "rb") if isinstance(path, Location) else path


# -- appending and parquet reads, for files the head keeps adding to or reads back -------------------

class _ObjectAppender:
    """A text file opened for appending on an object store, which has no append: the whole object is
    rewritten (one atomic write) with everything so far, at most every `interval_s` on `flush` and always
    on `close`. A crash loses at most the last `interval_s` of lines (events.log, timeline.jsonl: for
    people and plots, never the resume point)."""

    def __init__(self, url: str, interval_s: float = 5.0) -> None:
        import time

        self.url, self.interval_s, self._time = url, interval_s, time.monotonic
        self._parts = [read_text(url)] if exists(url) else []
        self._dirty, self._last = False, 0.0

    def write(self, text: str) -> int:
        self._parts.append(text)
        self._dirty = True
        return len(text)

    def flush(self, force: bool = False) -> None:
        if self._dirty and (force or self._time() - self._last >= self.interval_s):
            write_atomic(self.url, "".join(self._parts).encode("utf-8"))
            self._dirty, self._last = False, self._time()

    def close(self) -> None:
        self.flush(force=True)

    def __enter__(self) -> _ObjectAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_append(path: str | os.PathLike):
    """A text file to append lines to: the file itself locally, an `_ObjectAppender` on an object store."""
    if is_object_store(path):
        return _ObjectAppender(str(path))
    return open(path, "a", encoding="utf-8")


def read_parquet(path: str | os.PathLike, columns: list[str] | None = None):
    """pyarrow.parquet.read_table for a local path or an object (ranged reads of the footer and columns)."""
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_table(path, columns=columns)
    with open_file(str(path), "rb") as f:
        return pq.read_table(f, columns=columns)


def read_parquet_metadata(path: str | os.PathLike):
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_metadata(path)
    with open_file(str(path), "rb") as f:
        return pq.read_metadata(f)


def read_parquet_schema(path: str | os.PathLike):
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_schema(path)
    with open_file(str(path), "rb") as f:
        return pq.read_schema(f)
