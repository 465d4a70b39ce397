"""The run directory's layout (docs/run-directory.md) and the plan's identity (run.json)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from orchestrator.state.manifest import CorruptRunFile, RECOVER
from orchestrator.storage.atomic import atomic_write_text


class PlanMismatch(RuntimeError):
    """The run directory was planned for different samples; the message says what differs and what to do."""


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def manifest(self) -> Path:
        return self.root / "batches.jsonl"

    @property
    def batches(self) -> Path:
        return self.root / "batches"

    @property
    def rejected(self) -> Path:
        return self.root / "rejected.jsonl"

    @property
    def outputs(self) -> Path:
        return self.root / "outputs"

    @property
    def events(self) -> Path:
        return self.root / "events.log"

    @property
    def timeline(self) -> Path:
        """Slices' throughput and occupancy over time, appended by the head (JSON lines; for status and the plot)."""
        return self.root / "timeline.jsonl"

    @property
    def progress(self) -> Path:
        """The running head's live figures (tokens/s, ETA), replaced every few seconds."""
        return self.root / "progress.json"

    @property
    def plot(self) -> Path:
        return self.root / "throughput.png"

    def output_file(self, batch_id: str) -> Path:
        return self.outputs / f"{batch_id}.parquet"

    def batch_file(self, batch_id: str) -> Path:
        return self.batches / f"{batch_id}.parquet"

    def is_planned(self) -> bool:
        """A plan is complete once batches.jsonl exists (it is written last)."""
        return self.manifest.exists() and self.run_json.exists()

    def read_run_json(self) -> dict[str, Any]:
        """run.json; raises CorruptRunFile naming the file and line when it does not parse."""
        try:
            info = json.loads(self.run_json.read_bytes())
        except json.JSONDecodeError as e:
            raise CorruptRunFile(f"{self.run_json} line {e.lineno} column {e.colno} is corrupt ({e.msg}); {RECOVER}") \
                from None
        except (UnicodeDecodeError, RecursionError) as e:
            raise CorruptRunFile(f"{self.run_json} is corrupt ({type(e).__name__}); {RECOVER}") from None
        if not isinstance(info, dict) or not {"plan", "fingerprints", "sample_affecting"} <= info.keys():
            raise CorruptRunFile(f"{self.run_json} is not a run description (plan, fingerprints and sample_affecting "
                                 f"are required); {RECOVER}")
        return info

    def write_run_json(self, info: dict[str, Any]) -> None:
        atomic_write_text(self.run_json, json.dumps(info, indent=2, sort_keys=True) + "\n")


def config_hash(sample_affecting: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(sample_affecting, sort_keys=True).encode()).hexdigest()


def versions() -> dict[str, str]:
    out = {}
    for dist in ("pagefleet", "transformers", "tokenizers", "ray", "pyarrow", "jax"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out

