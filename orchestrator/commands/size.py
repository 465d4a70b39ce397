"""`pagefleet size`: flags in, the sizing report of `orchestrator/plan/size.py` out (text or --json)."""

from __future__ import annotations

import argparse
import json

from orchestrator.plan.size import CHIPS, DTYPE_BYTES, SizingError, read_model_config, size
from orchestrator.plan.size_split import format_table, split_table


def main(argv: list[str]) -> int:
    """`pagefleet size`: print the sizing report (text, or JSON with --json)."""
    parser = argparse.ArgumentParser(
        prog="pagefleet size",
        description="Engine capacities and a decode throughput bound for a model on a TPU or GPU slice, from config.json alone.")
    parser.add_argument("--model", required=True, help="checkpoint directory holding config.json, or the file itself")
    parser.add_argument("--chip", choices=sorted(CHIPS), help="fills --hbm-gib and --hbm-gb-per-s from the chip's documentation")
    parser.add_argument("--chips", type=int, default=None, help="chips per slice (default: --tp)")
    parser.add_argument("--hbm-gib", type=float, default=None, help="HBM per chip in GiB")
    parser.add_argument("--hbm-gb-per-s", type=float, default=None, help="HBM bandwidth per chip in GB/s")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel width (cluster.mesh.model); without it, --chips prints every split of the "
                             "slice into cluster.mesh {data, model} and marks the best")
    parser.add_argument("--chips-per-host", type=int, default=None,
                        help="chips of one host (default: the chip's usual host, see docs/sizing.md)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--prompt-tokens", type=int, required=True, help="longest prompt accepted, in tokens")
    parser.add_argument("--new-tokens", type=int, required=True, help="sampling.max_new_tokens")
    parser.add_argument("--page-size", type=int, default=16, help="engine.page_size in tokens")
    parser.add_argument("--reserve-fraction", type=float, default=0.15,
                        help="fraction of HBM kept for activations, logits and compile workspace (default 0.15)")
    parser.add_argument("--max-seqs-cap", type=int, default=256, help="upper bound on the suggested max_seqs")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    chip = CHIPS.get(args.chip) if args.chip else None
    hbm_gib = args.hbm_gib if args.hbm_gib is not None else (chip.hbm_gib if chip else None)
    bandwidth = args.hbm_gb_per_s if args.hbm_gb_per_s is not None else (chip.hbm_gb_per_s if chip else None)
    if hbm_gib is None or bandwidth is None:
        raise SizingError("pass --chip (one of " + ", ".join(sorted(CHIPS)) + ") or both --hbm-gib and --hbm-gb-per-s")
    cfg, name = read_model_config(args.model)
    common = dict(hbm_gib=hbm_gib, hbm_gb_per_s=bandwidth, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                  new_tokens=args.new_tokens, page_size=args.page_size, reserve_fraction=args.reserve_fraction,
                  max_seqs_cap=args.max_seqs_cap, model_name=name, chip=args.chip,
                  peak_tflops=chip.peak_bf16_tflops if chip and args.dtype != "float32" else None)
    if args.tp is None and args.chips is not None:
        per_host = args.chips_per_host or (chip.chips_per_host(args.chips) if chip else args.chips)
        rows = split_table(cfg, chips=args.chips, chips_per_host=per_host, **common)
        print(json.dumps([r.to_json() for r in rows], indent=2) if args.json else
              format_table(rows, chips=args.chips, chips_per_host=per_host, chip=args.chip))
        return 0
    report = size(cfg, tp=args.tp or 1, chips_per_slice=args.chips, **common)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format())
    return 0
