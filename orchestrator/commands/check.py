"""`pagefleet check`'s command line; `orchestrator.plan.check` answers it."""

from __future__ import annotations

import argparse
import sys

from orchestrator.exit_codes import FAULT, OK
from orchestrator.plan.check import TARGETS, Refused, run_check


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet check")
    parser.add_argument("config")
    parser.add_argument("--target", choices=TARGETS, default=None)
    args, overrides = parser.parse_known_args(argv)
    try:
        print(run_check(args.config, overrides, args.target))
    except Refused as e:
        print(f"pagefleet check: refused: {e}", file=sys.stderr)
        return FAULT
    return OK
