"""The shared help of the commands that take a run config (`pagefleet run`, `pagefleet plan`)."""

from __future__ import annotations

import sys

from orchestrator.config import KEYS_DOC, RunConfig
from orchestrator.config_reference import help_text


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def needs_help(argv: list[str]) -> bool:
    """No config path first, or -h/--help: the command answers with `config_help` instead of running."""
    return not argv or argv[0].startswith("-") or wants_help(argv)


def config_help(command: str, doc: str, argv: list[str]) -> int:
    """`pagefleet run|plan --help`: usage and every config key (exit 0); a usage line without a config (exit 2)."""
    usage = f"usage: pagefleet {command} CONFIG.yaml [--section.key=value ...]"
    if not wants_help(argv):
        print(f"{usage}  (pagefleet {command} --help lists the keys)", file=sys.stderr)
        return 2
    print(f"{usage}\n\n{doc}\n\nkeys (in the YAML file or as overrides; {KEYS_DOC} has the same list):\n"
          f"{help_text(RunConfig)}")
    return 0
