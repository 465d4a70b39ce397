"""The corpus's files: which they are (a file, a directory searched recursively, or a glob) and their fingerprint.

Every file named is in the plan, or the plan stops: a directory this user may not read is an error naming it (fsspec's
own walk leaves such a directory out, its files with it, without a word: rows lost before any were read), and so is a
file compressed whole. What a directory holds under a name starting with "." or "_" is left out, with a warning naming
it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from glob import has_magic

import fsspec
from fsspec.utils import glob_translate

from orchestrator.storage.readable import reading
from orchestrator.surface import setting

log = logging.getLogger(__name__)

KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
"""A corpus file's kind by its suffix, in any case (`.JSONL` too): JSON lines (`.ndjson` is another name for them), a
JSON document (or JSON lines), parquet. Any other file in the corpus's directory or glob is not the corpus's."""
HIDDEN = (".", "_")
"""A name starting with one of these, below a corpus directory, is not the corpus's (`hidden`), as pyarrow's datasets,
Spark and Hive leave such names out of a table's directory."""
COMPRESSED = (".gz", ".bz2", ".xz", ".lzma", ".zst", ".zstd", ".lz4", ".snappy", ".zip")
"""Suffixes of a file compressed whole: a corpus file so compressed (`part-0.jsonl.gz`) is refused, naming the fix,
where it would otherwise be left out of a directory or glob unsaid."""


def list_files(path: str, warn: bool = True) -> list[str]:
    """The corpus files, sorted; an error names the path when there are none, and any directory of it this user may
    not read (a local one; an object store has no directory to refuse). Hidden names (starting with "." or "_")
    below a directory (or below a glob's fixed part, unless the glob spells such a name) are left out, with a warning
    naming them: `.ipynb_checkpoints/` holds stale copies of the files beside it, `._x.jsonl` is macOS's metadata,
    `.Trash-1000/` another user's, `_temporary/` a Spark job's unfinished or failed tasks' files, `_delta_log/` a
    Delta table's log; read with the rest, they would sample stale or doubled rows. `warn`: False for a listing
    made before the one the plan reads (the plan warns then)."""
    fs, root = fsspec.core.url_to_fs(path)
    local = fs.protocol in ("file", ("file", "local"))
    hidden: list[str] = []
    with reading("corpus.path", path):
        if fs.isdir(root):
            found = _walk(root, None, hidden) if local else _visible(fs.find(root), root, hidden)
        elif has_magic(root):
            prefix, rest = _glob_parts(root)
            keep = hidden if not any(_hidden(part) for part in rest.split("/")) else None  # None: asked for
            found = _local_glob(root, prefix, rest, keep) if local else [p for p in fs.glob(root) if not fs.isdir(p)]
            found = found if keep is None or local else _visible(found, prefix, keep)
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
    if hidden and warn:
        named = ", ".join(sorted(hidden)[:3]) + (f" and {len(hidden) - 3} more" if len(hidden) > 3 else "")
        log.warning("corpus.path %r: left out %d hidden %s (a name starting with '.' or '_'): %s; to read one, name it (a "
                    "file, or a glob that spells its name)", path, len(hidden),
                    "entry" if len(hidden) == 1 else "entries", named)
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


def _hidden(name: str) -> bool:
    return name.startswith(HIDDEN)


def _corpus_name(path: str) -> bool:
    """A name a corpus file has (or one compressed whole): a hidden one is named among those left out."""
    return file_kind(path) is not None or _compressed(path)


def _glob_parts(root: str) -> tuple[str, str]:
    """(the directory before a glob's first wildcard, the pattern after it)."""
    parts = root.split("/")
    first = next(i for i, part in enumerate(parts) if has_magic(part))
    return "/".join(parts[:first]) or "/", "/".join(parts[first:])


def _local_glob(root: str, prefix: str, rest: str, hidden: list[str] | None) -> list[str]:
    """The local files a glob matches (fsspec's glob syntax, `**` any number of levels), reading no directory deeper
    than the glob reaches; `hidden` as for _walk (None: the glob spells a hidden name, and reads them all)."""
    pattern = re.compile(glob_translate(root))
    depth = None if "**" in rest else rest.count("/") + 1
    return [p for p in _walk(prefix, depth, hidden) if pattern.match(p)]


def _visible(paths: list[str], base: str, hidden: list[str]) -> list[str]:
    """`paths` but those with a hidden name below `base` (an object store's listing); the corpus files
    and directories so left out are added to `hidden`."""
    kept, left = [], set()
    for p in paths:
        parts = p[len(base.rstrip("/")) + 1:].split("/")
        at = next((i for i, part in enumerate(parts) if _hidden(part)), None)
        if at is None:
            kept.append(p)
        elif at < len(parts) - 1 or _corpus_name(p):
            left.add(base.rstrip("/") + "/" + "/".join(parts[:at + 1]))
    hidden.extend(sorted(left))
    return kept


def _walk(top: str, depth: int | None, hidden: list[str] | None) -> list[str]:
    """The files under directory `top`, down to `depth` levels (None: all). A link to a directory is followed (its
    files are the corpus's as much as any), each directory walked once, by its real path: a link back up (a loop) or a
    second link to one directory adds no file twice. A directory this user may not read raises its PermissionError
    (ext file systems' `lost+found` excepted: a volume's root holds one, only root may read it, and it is never the
    corpus's). Hidden names are neither listed nor walked into: the directories and corpus files so left
    out are added to `hidden` (None: they are walked and listed like any)."""
    def refuse(e: OSError) -> None:
        if os.path.basename(e.filename or "") != "lost+found" or not isinstance(e, PermissionError):
            raise e

    found, seen, levels = [], set(), top.rstrip("/").count("/")
    for directory, dirs, names in os.walk(top, onerror=refuse, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:  # walked already, by another path
            dirs.clear()
            continue
        seen.add(real)
        if hidden is not None:
            hidden.extend(os.path.join(directory, d) for d in dirs if _hidden(d))
            hidden.extend(os.path.join(directory, n) for n in names if _hidden(n) and _corpus_name(n))
            dirs[:] = [d for d in dirs if not _hidden(d)]
            names = [n for n in names if not _hidden(n)]
        dirs.sort()  # the first of two paths to one directory is the same one at every listing
        if depth is not None and directory.rstrip("/").count("/") - levels + 1 >= depth:
            dirs.clear()
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
