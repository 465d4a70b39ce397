"""The corpus's files: which they are (a file, a directory searched recursively, or a glob) and their fingerprint.

Every file named is in the plan, or the plan stops: a directory this user may not read is an error naming it (fsspec's
own walk leaves such a directory out, its files with it, without a word: rows lost before any were read).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from glob import has_magic

import fsspec
from fsspec.utils import glob_translate

from orchestrator.storage.readable import reading
from orchestrator.surface import setting

KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
"""A corpus file's kind by its suffix, in any case (`.JSONL` too): JSON lines (`.ndjson` is another name for them), a
JSON document (or JSON lines), parquet. Any other file in the corpus's directory or glob is not the corpus's."""
COMPRESSED = (".gz", ".bz2", ".xz", ".lzma", ".zst", ".zstd", ".lz4", ".snappy", ".zip")
"""Suffixes of a file compressed whole: a corpus file so compressed (`part-0.jsonl.gz`) is refused, naming the fix,
where it would otherwise be left out of a directory or glob unsaid."""


def list_files(path: str) -> list[str]:
    """The corpus files, sorted; an error names the path when there are none, and any directory of it this user may
    not read (a local one; an object store has no directory to refuse)."""
    fs, root = fsspec.core.url_to_fs(path)
    local = fs.protocol in ("file", ("file", "local"))
    with reading("corpus.path", path):
        if local and (fs.isdir(root) or has_magic(root)):
            found = _local_files(root)
        elif fs.isdir(root):
            found = fs.find(root)
        elif has_magic(root):
            found = [p for p in fs.glob(root) if not fs.isdir(p)]
        elif fs.exists(root):
            if not _compressed(root) and file_kind(root) is None:
                raise ValueError(f"corpus.path {path!r}: unsupported file type; use one of {', '.join(KINDS)}")
            found = [root]
        else:
            raise FileNotFoundError(f"corpus.path {path!r} does not exist; pass "
                                    f"{setting('corpus.path', 'FILE|DIR|GLOB')}")
    if packed := sorted(p for p in found if _compressed(p)):
        more = f" (and {len(packed) - 1} more)" if len(packed) > 1 else ""
        raise ValueError(f"corpus.path {path!r}: {packed[0]} is compressed{more}; pagefleet reads {', '.join(KINDS)} "
                         f"files as they are: decompress them, convert them to parquet (which compresses its own "
                         f"pages), or leave them out with a glob (corpus.path=DIR/*.jsonl)")
    found = [p for p in found if file_kind(p) is not None]
    if not found:
        raise FileNotFoundError(f"corpus.path {path!r} holds no {'/'.join(KINDS)} files")
    return sorted(p if local else fs.unstrip_protocol(p) for p in found)


def file_kind(path: str) -> str | None:
    """"jsonl", "json" or "parquet" by the file's suffix (KINDS); None for a file that is not the corpus's."""
    return KINDS.get(os.path.splitext(path)[1].lower())


def _compressed(path: str) -> bool:
    """A corpus file compressed whole (`.jsonl.gz`, `.json.zst`, ...)."""
    stem, suffix = os.path.splitext(path)
    return suffix.lower() in COMPRESSED and file_kind(stem) is not None


def _local_files(root: str) -> list[str]:
    """The files a local directory holds (recursively), or those a glob matches (fsspec's glob syntax, `**` any
    number of levels), reading no directory deeper than the glob reaches."""
    if not has_magic(root):
        return _walk(root, None)
    parts = root.split("/")
    first = next(i for i, part in enumerate(parts) if has_magic(part))
    pattern = re.compile(glob_translate(root))
    depth = None if "**" in root else len(parts) - first
    return [p for p in _walk("/".join(parts[:first]) or "/", depth) if pattern.match(p)]


def _walk(top: str, depth: int | None) -> list[str]:
    """The files under directory `top`, down to `depth` levels (None: all). A link to a directory is followed (its
    files are the corpus's as much as any), each directory walked once, by its real path: a link back up (a loop) or a
    second link to one directory adds no file twice. A directory this user may not read raises its PermissionError
    (ext file systems' `lost+found` excepted: a volume's root holds one, only root may read it, and it is never the
    corpus's)."""
    def refuse(e: OSError) -> None:
        if os.path.basename(e.filename or "") != "lost+found" or not isinstance(e, PermissionError):
            raise e

    found, seen, levels = [], set(), top.rstrip("/").count("/")
    for directory, dirs, names in os.walk(top, onerror=refuse, followlinks=True):
        real = os.path.realpath(directory)
        dirs.sort()  # the first of two paths to one directory is the same one at every listing
        if real in seen or (depth is not None and directory.rstrip("/").count("/") - levels + 1 >= depth):
            dirs.clear()
        if real in seen:
            continue
        seen.add(real)
        found.extend(os.path.join(directory, name) for name in names)
    return found


def corpus_fingerprint(files: list[str]) -> str:
    """sha256 over each file's name, size and modification time.

    Metadata rather than content: resuming must check the corpus without reading it again (it may
    be terabytes); size plus mtime (or the object store's update time) catches edits in place.
    """
    digest = hashlib.sha256()
    for url in files:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
        mtime = info.get("mtime") or info.get("updated") or info.get("LastModified") or info.get("created")
        digest.update(json.dumps([url, info.get("size"), str(mtime)]).encode())
    return digest.hexdigest()
