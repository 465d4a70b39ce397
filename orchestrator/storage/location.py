"""A `gs://` object or prefix that reads like a `pathlib.Path`, so the run directory's readers take either kind."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.storage.storage import exists, filesystem, is_url, join, list_names, read_bytes, remove


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
        fs, p = filesystem(self.url)
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
