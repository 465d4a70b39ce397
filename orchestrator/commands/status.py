"""`pagefleet status RUN_DIR`: progress of a run directory: counts, tokens, throughput, ETA, failed batches."""

from __future__ import annotations

import argparse

from orchestrator.json_out import dumps
from orchestrator.observe.status import format_status, status
from orchestrator.storage.readable import reading


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet status", description="Progress of a run directory.")
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    with reading("RUN_DIR", args.run_dir, workers_read=False):  # status only reads the run directory
        s = status(args.run_dir)
    print(dumps(s, indent=1) if args.json else format_status(s))
    return 0
