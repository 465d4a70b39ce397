"""The `pagefleet` command line. Each subcommand imports its heavy modules lazily."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from engine import traces
from orchestrator.exit_codes import BATCHES_FAILED, FAULT, INTERRUPTED, OK


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def _config_help(command: str, doc: str | None, argv: list[str]) -> int:
    """`pagefleet run|plan --help`: usage and every config key (exit 0); a usage line without a config (exit 2)."""
    usage = f"usage: pagefleet {command} CONFIG.yaml [--section.key=value ...]"
    if not _wants_help(argv):
        print(f"{usage}  (pagefleet {command} --help lists the keys)", file=sys.stderr)
        return 2
    from orchestrator.config import KEYS_DOC, RunConfig
    from orchestrator.config_reference import help_text

    print(f"{usage}\n\n{doc}\n\nkeys (in the YAML file or as overrides; {KEYS_DOC} has the same list):\n"
          f"{help_text(RunConfig)}")
    return 0


def _init_model(argv: list[str]) -> int:
    """Write a small randomly initialised model in Hugging Face format (presets)."""
    from engine import PRESETS, write_model

    parser = argparse.ArgumentParser(prog="pagefleet init-model", description="Write a randomly initialised model in Hugging Face format.")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--output", required=True, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_model(args.preset, args.output, seed=args.seed)
    print(f"wrote {args.preset} to {args.output}")
    return 0


def _generate(argv: list[str]) -> int:
    """The engine alone in one process, no Ray: JSON lines of prompts in, sample records out."""
    from orchestrator.commands.generate import main as generate_main

    return generate_main(argv)


def _plan(argv: list[str]) -> int:
    """Plan only: read, tokenize and pack the corpus into batches; print the capacity report."""
    if not argv or argv[0].startswith("-") or _wants_help(argv):
        return _config_help("plan", _plan.__doc__, argv)
    from orchestrator.config import ConfigError, load_run_config
    from orchestrator.run.lock import RunDirLocked
    from orchestrator.run.rundir import PlanMismatch
    from orchestrator.slices.cluster import ClusterGone

    try:
        cfg = load_run_config(argv[0], argv[1:])
        from orchestrator.plan.planner import plan

        result = plan(cfg)
    except (ConfigError, PlanMismatch, RunDirLocked, ClusterGone, FileNotFoundError, ValueError) as e:
        print(f"pagefleet plan: {e}", file=sys.stderr)
        return FAULT
    if result.already_planned:
        print(f"{result.run_dir} is already planned with this config and corpus; nothing to do")
    print(result.stats.format())
    print(f"plan written to {result.run_dir}")
    return 0


def _run(argv: list[str]) -> int:
    """Plan if needed, then run every batch that is not done on the Ray cluster (resumes a stopped run)."""
    if not argv or argv[0].startswith("-") or _wants_help(argv):
        return _config_help("run", _run.__doc__, argv)
    from orchestrator.config import ConfigError, load_run_config
    from orchestrator.run.lock import RunDirLocked
    from orchestrator.run.rundir import PlanMismatch
    from orchestrator.slices.cluster import ClusterGone

    try:
        cfg = load_run_config(argv[0], argv[1:])
        from orchestrator.run.driver import Driver

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


def _status(argv: list[str]) -> int:
    """Progress of a run directory: counts, tokens, throughput, ETA, failed batches."""
    parser = argparse.ArgumentParser(prog="pagefleet status", description="Progress of a run directory.")
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    from orchestrator.observe.status import format_status, status

    s = status(args.run_dir)
    from orchestrator.json_out import dumps

    print(dumps(s, indent=1) if args.json else format_status(s))
    return 0


def _export(argv: list[str]) -> int:
    """Write every sample of a run in corpus order to one JSON lines or Parquet file."""
    parser = argparse.ArgumentParser(prog="pagefleet export", description="All samples in corpus order.")
    parser.add_argument("run_dir")
    parser.add_argument("--output", required=True, help="FILE.jsonl or FILE.parquet")
    parser.add_argument("--partial", action="store_true", help="export the done batches of an unfinished run")
    parser.add_argument("--memory-gb", type=float, default=2.0,
                        help="memory the sort may hold (default 2); a larger run is sorted in runs on disk beside "
                             "--output, about as much space as the run's outputs/")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress on stderr (default on)")
    args = parser.parse_args(argv)
    if args.memory_gb <= 0:
        parser.error(f"--memory-gb must be positive, got {args.memory_gb}")
    from tqdm import tqdm

    from orchestrator.commands.export import check_output, count_samples, done_outputs, export, print_progress

    check_output(args.output)  # before the progress bar, so a refusal is the only line printed
    total = count_samples(done_outputs(args.run_dir, partial=args.partial))
    try:
        with tqdm(total=total, desc="export", unit="sample", disable=not args.progress, file=sys.stderr) as bar:
            count = export(args.run_dir, args.output, partial=args.partial, memory_bytes=int(args.memory_gb * 2**30),
                           log=print_progress if args.progress else None, on_rows=bar.update)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"pagefleet export: out of disk space beside {args.output} ({e}): the output and, for a run bigger "
              "than --memory-gb, the sort's temporary runs each need about the size of the run's outputs/; free "
              "space there, write --output elsewhere, or raise --memory-gb", file=sys.stderr)
        return FAULT
    print(f"wrote {count:,} samples to {args.output}")
    return 0


def _size(argv: list[str]) -> int:
    """Engine capacities for a model on a TPU slice, from its config.json alone."""
    from orchestrator.commands.size_command import main as size_main

    return size_main(argv)


def _check(argv: list[str]) -> int:
    """Pre-flight without the accelerator: the head's validation, step programs lowered for the target, VMEM and HBM."""
    from orchestrator.commands.check import main as check_main

    return check_main(argv)


def _serve(argv: list[str]) -> int:
    """The HTTP control plane on Ray Serve: submit, watch, read, cancel and resume runs."""
    from orchestrator.commands.serve_command import main as serve_main

    return serve_main(argv)


COMMANDS = {
    "run": _run,
    "status": _status,
    "export": _export,
    "plan": _plan,
    "init-model": _init_model,
    "generate": _generate,
    "size": _size,
    "check": _check,
    "serve": _serve,
}


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n", 1)[0]


def usage() -> str:
    """`pagefleet --help`: each command with the first line of its handler's docstring."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {_first_line(handler.__doc__)}" for name, handler in COMMANDS.items()]
    return ("usage: pagefleet COMMAND [ARGS ...]   (pagefleet COMMAND --help for its arguments; --version)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\nDocumentation: README.md and docs/ in the repository.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--version":
        from pagefleet import __version__

        print(f"pagefleet {__version__}")
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
        return COMMANDS[command](rest)
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
        else:
            print(f"pagefleet {command}: {e}", file=sys.stderr)
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
    import logging

    class _NoTorchNotice(logging.Filter):  # transformers' import-time notice, which would read as a fault
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith("PyTorch was not found")

    logging.getLogger("transformers").addFilter(_NoTorchNotice())
    return True


def entry() -> int:
    """The `pagefleet` console script and `python -m orchestrator`: `main` in a process without torch."""
    hide_torch()
    return main()

