"""`pagefleet run CONFIG.yaml`: plan if needed, then run every batch that is not done (resumes a stopped run)."""

from __future__ import annotations

import os
import sys

from orchestrator.commands.run_config_help import config_help, needs_help
from orchestrator.config import ConfigError, load_run_config
from orchestrator.exit_codes import BATCHES_FAILED, FAULT, INTERRUPTED
from orchestrator.run.driver import Driver
from orchestrator.slices.cluster import ClusterGone
from orchestrator.state.lock import RunDirLocked
from orchestrator.state.rundir import PlanMismatch

DOC = "Plan if needed, then run every batch that is not done on the Ray cluster (resumes a stopped run)."


def main(argv: list[str]) -> int:
    if needs_help(argv):
        return config_help("run", DOC, argv)
    try:
        cfg = load_run_config(argv[0], argv[1:])
        # A bar on a terminal, plain lines elsewhere (ray job logs); PAGEFLEET_PROGRESS=0 turns both off.
        outcome = Driver(cfg, show_progress=os.environ.get("PAGEFLEET_PROGRESS", "1").strip() != "0").run()
    except (ConfigError, PlanMismatch, RunDirLocked, ClusterGone) as e:
        print(f"pagefleet run: {e}", file=sys.stderr)
        return FAULT
    if outcome.exit_code == FAULT:
        print(f"pagefleet run: stopped on a fault: {outcome.fault}", file=sys.stderr)
    elif outcome.exit_code == INTERRUPTED:
        print("pagefleet run: stopped; rerun the same command to resume", file=sys.stderr)
    elif outcome.exit_code == BATCHES_FAILED:
        failed = outcome.summary["failed"]
        first = next(iter(failed.items()), None)
        example = f" (first, {first[0]}: {(first[1] or '?').strip().splitlines()[-1]})" if first else ""
        print(f"pagefleet run: {outcome.summary['batches_failed']} batches failed and "
              f"{outcome.summary['batches_pending']} did not run{example}; `pagefleet status "
              f"{outcome.summary['run_dir']}` shows the errors, and rerunning retries them", file=sys.stderr)
    return outcome.exit_code
