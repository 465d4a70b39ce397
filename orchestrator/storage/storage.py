"""Where pagefleet's files live: a local path or an object store URL (`gs://bucket/key`), one API for both.

Every read and write of durable state goes through here, so the two kinds of storage keep the same
guarantees:

- `write_atomic`: all or nothing. Locally a temporary file, fsync, then rename (atomic.py); on an
  object store one whole-object upload, which Cloud Storage makes visible all at once or not at all
  (no temporary object, no rename: a rename there is a copy and a delete).

The plain reads, listings and uploads are engine/files.py's (the engine reads checkpoints with them too), named
here too so the orchestrator has one storage API. The rest of the storage layer, one concept
a module: compare-and-swap on object generations (generations.py), a pathlib-like view of an object
(location.py), appending to an object (object_append.py), parquet reads by ranged requests (parquet_io.py).
"""

from __future__ import annotations

import os

from engine import files
from orchestrator.storage.atomic import atomic_write_bytes

# engine/files.py's reads, listings and uploads, named here so the orchestrator has one storage API.
OBJECT_STORES = files.OBJECT_STORES
(exists, file_size, filesystem, is_object_store, is_url, join, list_names, list_sizes, local_path, makedirs, open_file,
 read_bytes, read_text, remove, remove_tree, upload_file) = (
    files.exists, files.file_size, files.filesystem, files.is_object_store, files.is_url, files.join, files.list_names,
    files.list_sizes, files.local_path, files.makedirs, files.open_file, files.read_bytes, files.read_text, files.remove,
    files.remove_tree, files.upload_file)

__all__ = ["OBJECT_STORES", "exists", "file_size", "filesystem", "is_object_store", "is_url", "join", "list_names",
           "list_sizes", "local_path", "makedirs", "open_file", "read_bytes", "read_text", "remove", "remove_tree", "upload_file", "write_atomic"]


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data`, all or nothing (see the module docstring)."""
    if not is_url(path):
        atomic_write_bytes(path, data)
        return
    fs, p = filesystem(path)
    fs.pipe_file(p, data)
