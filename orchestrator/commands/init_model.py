"""`pagefleet init-model`: write a small randomly initialised model in Hugging Face format (presets)."""

from __future__ import annotations

import argparse

from engine import PRESETS, write_model


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet init-model",
                                     description="Write a randomly initialised model in Hugging Face format.")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--output", required=True, help="directory to write (created)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_model(args.preset, args.output, seed=args.seed)
    print(f"wrote {args.preset} to {args.output}")
    return 0
