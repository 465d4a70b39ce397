"""What a service run may read: corpus and model paths under the operator's data roots, URLs only from allowed buckets.

`pagefleet serve` hands a token holder the power to start runs, and a run reads its corpus and model; without a
limit, `corpus.path: ~/.aws/credentials.json` would return the secret as prompt ids, and `corpus.path:
http://169.254.169.254/...` would make the server fetch any URL. So every path a submitted (or resumed) config
names is checked before anything opens it:

- a local path is resolved (symlinks, `..`, relative to the service's working directory) and must lie under a
  data root (`--data-root`, repeatable; default the runs root's parent); for a corpus, every file it lists, and
  for a model or tokenizer directory, every entry, must resolve under a root too (a link inside a root that
  points out of it is refused);
- a path fsspec reads from the local file system in another spelling (`file:/x`, `file:///x`, `local:/x`,
  `file:~/x`) is resolved the way the opener resolves it (`storage.local_path`, fsspec's own `url_to_fs`) and
  checked as a local path; a model path that is not a local directory is resolved as the planner resolves a Hub
  id (its snapshot in the local Hub cache) and that snapshot must lie under a root;
- a URL (anything else fsspec would read with a protocol: `gs://`, `http://`, `memory://`, a `::` chain)
  is refused unless the operator allowed its scheme and bucket (`--allow-url gs://bucket`); the bucket (URL
  host) must match exactly.

A refusal is a ConfigError (HTTP 400) naming the key. The check runs when the request arrives; whoever can write
under a data root can change what lies there afterwards, so data roots should be directories that only trusted
users write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from orchestrator.config import ConfigError, RunConfig
from orchestrator.plan.corpus_files import list_files
from orchestrator.plan.model_source import resolve_model
from orchestrator.storage.storage import local_path


class PathRefused(ConfigError):
    """A config path outside the data roots, or a URL the operator did not allow (HTTP 400)."""


@dataclass(frozen=True)
class DataPolicy:
    roots: tuple[Path, ...]
    """Resolved directories under which corpus and model paths must lie."""
    urls: tuple[tuple[str, str], ...] = ()
    """(scheme, bucket) pairs that may be read, e.g. ("gs", "my-bucket")."""
    base: Path = Path(".")
    """Directory relative paths in configs are resolved against (where `pagefleet serve` started)."""

    @classmethod
    def build(cls, roots: list[str] | tuple[str, ...], urls: list[str] | tuple[str, ...], base: str) -> DataPolicy:
        """The policy from the operator's flags; a malformed --allow-url raises ValueError naming it."""
        return cls(tuple(Path(os.path.realpath(os.path.join(base, r))) for r in roots),
                   tuple(allowed_url(u) for u in urls), Path(os.path.realpath(base)))

    def check(self, cfg: RunConfig) -> None:
        """Refuse `cfg` if it names a path the service may not read (PathRefused, naming the key)."""
        self._check_corpus(cfg.corpus.path)
        for key, value in (("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer)):
            if value is not None:
                self._check_directory(key, value)

    def _check_corpus(self, value: str) -> None:
        local = self._local("corpus.path", value)
        if local is None:
            return
        try:  # the files the planner will list (a directory's, a glob's), each of which may be a link
            files = list_files(str(local), warn=False)  # the run's plan warns of what it leaves out
        except (OSError, ValueError):
            return  # nothing readable there (its path itself is under a root); the run reports it when it plans
        for file in files:
            self._under_roots("corpus.path", value, file, f"its file {os.path.basename(file)}")

    def _check_directory(self, key: str, value: str) -> None:
        local = self._local(key, value)
        if local is None:
            return
        if not local.exists():  # not a local directory: the planner takes it for a Hub id in the local Hub cache
            try:
                resolved = resolve_model(value, key)
            except (OSError, ValueError) as e:
                raise ConfigError(str(e)) from None
            local = self._under_roots(key, value, resolved, "its Hub cache snapshot")
        if not local.is_dir():
            return
        for entry in os.scandir(local):  # config.json, weights and tokenizer files: each may be a link
            self._under_roots(key, value, entry.path, f"its entry {entry.name}")

    def _local(self, key: str, value: str) -> Path | None:
        """The resolved local path (checked under the roots), or None for an allowed URL. `file:`, `local:` and
        `file:~` paths are local: resolved as the opener resolves them (storage.local_path), relative paths against
        the service's working directory."""
        if not value.isprintable():  # NUL and other control characters (Cc), unpaired surrogates (Cs)
            raise PathRefused(f"{key} {value!r}: not a path (a NUL byte, a control character or an unpaired "
                              "surrogate); give the file's path as plain text")
        path = local_path(value if value.startswith(("/", "~")) or "://" in value or ":" in value.split("/")[0]
                          else str(self.base / value))
        if path is None:
            self._check_url(key, value)
            return None
        return self._under_roots(key, value, path, "it")

    def _under_roots(self, key: str, value: str, path: str, what: str) -> Path:
        resolved = Path(os.path.realpath(self.base / os.path.expanduser(path)))
        if not any(resolved == root or resolved.is_relative_to(root) for root in self.roots):
            roots = ", ".join(str(r) for r in self.roots)
            raise PathRefused(f"{key} {value!r}: {what} resolves outside the service's data roots ({roots}); put the "
                              "files under a data root, or have the operator add one (pagefleet serve --data-root DIR)")
        return resolved

    def _check_url(self, key: str, value: str) -> None:
        parts = urlsplit(value) if "::" not in value else None
        if parts is None or (parts.scheme.lower(), parts.netloc) not in self.urls:
            allowed = ", ".join(f"{s}://{b}" for s, b in self.urls) or "none"
            raise PathRefused(f"{key} {value!r} is a URL; the service reads URLs only from the buckets its operator "
                              f"allows (allowed: {allowed}; pagefleet serve --allow-url SCHEME://BUCKET), else use a "
                              "path under a data root")


def allowed_url(text: str) -> tuple[str, str]:
    """('gs', 'bucket') from 'gs://bucket'; refuses local schemes and anything but a scheme and a bucket."""
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if not scheme or not parts.netloc or parts.path.strip("/") or parts.query or parts.fragment or "::" in text:
        raise ValueError(f"--allow-url {text!r}: give a scheme and a bucket (host), e.g. gs://my-bucket")
    if scheme in ("file", "local", "memory"):
        raise ValueError(f"--allow-url {text!r}: local files are allowed with --data-root DIR, not as URLs")
    return scheme, parts.netloc
