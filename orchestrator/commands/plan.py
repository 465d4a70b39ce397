"""`pagefleet plan CONFIG.yaml`: read, tokenize and pack the corpus into batches; print the capacity report."""

from __future__ import annotations

import sys

from orchestrator.commands.run_config_help import config_help, needs_help
from orchestrator.config import ConfigError, load_run_config
from orchestrator.exit_codes import FAULT
from orchestrator.plan.planner import plan
from orchestrator.slices.cluster import ClusterGone
from orchestrator.state.lock import RunDirLocked
from orchestrator.state.rundir import PlanMismatch

DOC = "Plan only: read, tokenize and pack the corpus into batches; print the capacity report."


def main(argv: list[str]) -> int:
    if needs_help(argv):
        return config_help("plan", DOC, argv)
    try:
        result = plan(load_run_config(argv[0], argv[1:]))
    except (ConfigError, PlanMismatch, RunDirLocked, ClusterGone, FileNotFoundError, ValueError) as e:
        print(f"pagefleet plan: {e}", file=sys.stderr)
        return FAULT
    if result.already_planned:
        print(f"{result.run_dir} is already planned with this config and corpus; nothing to do")
    print(result.stats.format())
    print(f"plan written to {result.run_dir}")
    return 0
