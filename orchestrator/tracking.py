"""Experiment tracking (W&B or nothing); only the head talks to the tracker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrackerConfig:
    type: Literal["wandb", "noop"] = "wandb"
    """`wandb` logs to Weights & Biases; `noop` logs nothing."""
    project: str = "pagefleet"
    """W&B project."""
    mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode: `offline` writes run files and opens no connection."""
