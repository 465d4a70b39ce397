"""The `pagefleet` command line: the table of commands, the dispatch, and how every error becomes one line."""

from __future__ import annotations

import errno
import importlib
import logging
import os
import sys
from importlib import metadata

from engine import traces
from orchestrator.exit_codes import FAULT, INTERRUPTED, OK

try:
    VERSION = metadata.version("pagefleet")
except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    VERSION = "0+unknown"


COMMANDS = {
    "run": ("run", "Plan if needed, then run every batch that is not done on the Ray cluster (resumes a stopped run)."),
    "status": ("status", "Progress of a run directory: counts, tokens, throughput, ETA, failed batches."),
    "export": ("export", "Write every sample of a run in corpus order to one JSON lines or Parquet file."),
    "plan": ("plan", "Plan only: read, tokenize and pack the corpus into batches; print the capacity report."),
    "init-model": ("init_model", "Write a small randomly initialised model in Hugging Face format (presets)."),
    "generate": ("generate", "The engine alone in one process, no Ray: JSON lines of prompts in, sample records out."),
    "size": ("size", "Engine capacities for a model on a TPU slice, from its config.json alone."),
    "check": ("check", "Pre-flight without the accelerator: the head's validation, step programs lowered for the "
                       "target, VMEM and HBM."),
    "serve": ("serve", "The HTTP control plane on Ray Serve: submit, watch, read, cancel and resume runs."),
}
"""Each command: its module in orchestrator/commands/ (which has `main(argv) -> exit code`) and its line in
`pagefleet --help`. A command's module is imported when the command is chosen, after `hide_torch` and only for
that command: the one place a project import happens inside a function."""


def _command_main(command: str):
    return importlib.import_module(f"orchestrator.commands.{COMMANDS[command][0]}").main


def usage() -> str:
    """`pagefleet --help`: each command with the first line of its handler's docstring."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()]
    return ("usage: pagefleet COMMAND [ARGS ...]   (pagefleet COMMAND --help for its arguments; --version)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\nDocumentation: README.md and docs/ in the repository.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        print(f"pagefleet {VERSION}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return OK if argv else FAULT
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"pagefleet: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return FAULT
    try:
        traces()  # a bad PAGEFLEET_TRACE is refused here, on the head, before any slice or engine starts
        return _command_main(command)(rest)
    except KeyboardInterrupt:
        print(f"pagefleet {command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, FileNotFoundError) as e:  # configuration and input errors: the message names the fix
        if os.environ.get("PAGEFLEET_DEBUG"):
            raise
        print(f"pagefleet {command}: {e}", file=sys.stderr)
        return FAULT
    except OSError as e:  # a full disk (DiskFull names the file and the fix), a permission, a device
        if os.environ.get("PAGEFLEET_DEBUG"):
            raise
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            print(f"pagefleet {command}: {e.strerror or e}", file=sys.stderr)
        elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            print(f"pagefleet {command}: {e.filename or e}: {e.strerror}; make it writable by this user, or give "
                  "another location (run_dir, --output)", file=sys.stderr)
        else:  # one line whatever the library wrote (gcsfs: "Forbidden: PATH" and the store's message below it)
            print(f"pagefleet {command}: {' '.join(str(e).split())}", file=sys.stderr)
        return FAULT
    except Exception as e:  # noqa: BLE001 - a fault of pagefleet itself: exit FAULT, never "a batch failed"
        if os.environ.get("PAGEFLEET_DEBUG"):
            raise
        print(f"pagefleet {command}: internal error: {type(e).__name__}: {e} (rerun with PAGEFLEET_DEBUG=1 for "
              "the traceback)", file=sys.stderr)
        return FAULT


TORCH_ENV = "PAGEFLEET_ALLOW_TORCH"


def hide_torch() -> bool:
    """Make this process behave as if torch were not installed (pagefleet never uses it), unless
    `PAGEFLEET_ALLOW_TORCH=1`; returns whether it did.

    transformers imports torch whenever it is installed, before it decides a tokenizer's class (its
    configuration module needs it for rope): ~3 s of a first `pagefleet generate` on a machine with torch,
    for nothing. `importlib.util.find_spec` reports a module that is None in `sys.modules` as absent, so
    transformers takes its torch-free path, the one it takes where torch is not installed."""
    if os.environ.get(TORCH_ENV, "").strip().lower() in ("1", "true", "yes") or "torch" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]

    class _NoTorchNotice(logging.Filter):  # transformers' import-time notice, which would read as a fault
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith("PyTorch was not found")

    logging.getLogger("transformers").addFilter(_NoTorchNotice())
    return True


def entry() -> int:
    """The `pagefleet` console script and `python -m orchestrator`: `main` in a process without torch."""
    hide_torch()
    return main()

