"""Compare-and-swap on a Cloud Storage object's generation, for the run directory's lock and manifest.

`create_if_absent` / `replace_if_generation` / `delete_if_generation` carry Cloud Storage's
`ifGenerationMatch` precondition (0 means "no live object"). A lost race raises `PreconditionFailed`
naming the object; nothing is written.

gcsfs's `pipe_file(mode="create")` sends `ifGenerationMatch=0` but nothing takes another generation, and
its upload does not return the generation written, so these use google-cloud-storage (a dependency of
gcsfs): `Blob.upload_from_string(..., if_generation_match=G)` sends `ifGenerationMatch=G` and sets
`Blob.generation` from the response. It honours `STORAGE_EMULATOR_HOST`, as gcsfs does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from fsspec.core import split_protocol

from orchestrator.storage.storage import is_object_store


class PreconditionFailed(RuntimeError):
    """A conditional write lost its race: the object is not at the generation the writer expected."""


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
