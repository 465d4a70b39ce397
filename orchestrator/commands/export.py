"""`pagefleet export RUN_DIR --output FILE`: every sample of a run in corpus order, in one JSON lines or Parquet file."""

from __future__ import annotations

import argparse
import errno
import sys

from tqdm import tqdm

from orchestrator.exit_codes import FAULT
from orchestrator.export.export import LAYOUTS, check_output, done_outputs, export, print_progress
from orchestrator.storage.readable import reading


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet export", description="All samples in corpus order.")
    parser.add_argument("run_dir")
    parser.add_argument("--output", required=True, help="FILE.jsonl or FILE.parquet")
    parser.add_argument("--format", default="records", choices=LAYOUTS,
                        help="records: the sample records (default); openai_batch: OpenAI Batch output lines, one per "
                             "request, for a run of an OpenAI Batch file (corpus.format: openai_batch)")
    parser.add_argument("--partial", action="store_true", help="export the done batches of an unfinished run")
    parser.add_argument("--memory-gb", type=float, default=2.0,
                        help="memory the sort may hold (default 2); a larger run is sorted in runs on disk beside "
                             "--output, about as much space as the run's outputs/")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="progress on stderr (default on)")
    args = parser.parse_args(argv)
    if args.memory_gb <= 0:
        parser.error(f"--memory-gb must be positive, got {args.memory_gb}")
    check_output(args.output, args.format)  # before the progress bar, so a refusal is the only line printed
    with reading("RUN_DIR", args.run_dir, workers_read=False):  # its manifest and outputs' footers, only read
        done = done_outputs(args.run_dir, partial=args.partial)
    try:
        with tqdm(total=done.samples, desc="export", unit="sample", disable=not args.progress, file=sys.stderr) as bar:
            count = export(args.run_dir, args.output, partial=args.partial, memory_bytes=int(args.memory_gb * 2**30),
                           layout=args.format, done=done,
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