"""`pagefleet size` without `--tp`: every way to split a slice into `cluster.mesh: {data: D, model: T}`, sized by
`orchestrator/plan/size.py` (one engine of T chips, D of them), with the best one marked.

A split is feasible when the engine takes width T (`engine.models.tensor_parallel`), T divides the slice's chips and one
engine's weights leave room for a sequence's KV. It runs when D is 1 (one engine over every host) or when each
engine fits one host and D divides over the hosts (host-level data parallelism, docs/slices.md); a split of
several engines that each span hosts is listed but never chosen. The best runnable split has the highest
decode bound per slice; ties go to the narrower T (fewer collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import ModelConfig
from engine import valid_widths
from orchestrator.plan.size import GiB, SizeReport, SizingError, size


@dataclass(frozen=True)
class Split:
    data: int
    model: int
    report: SizeReport | None
    """None when the split does not fit (`why_not` says why)."""
    why_not: str | None = None
    """Why this split cannot run (does not fit, or needs host-level data parallelism); None when it can."""
    best: bool = False

    def to_json(self) -> dict:
        return {"data": self.data, "model": self.model, "best": self.best, "why_not": self.why_not,
                "report": self.report.to_json() if self.report else None}


def split_table(cfg: ModelConfig, *, chips: int, chips_per_host: int, **size_args) -> list[Split]:
    """Every (data, model) of a `chips`-chip slice with `chips_per_host` chips a host; `size_args` as `size`'s."""
    if chips < 1 or chips_per_host < 1 or (chips > chips_per_host and chips % chips_per_host):
        raise SizingError(f"--chips {chips} must be a positive multiple of --chips-per-host {chips_per_host}")
    rows = []
    for tp in [t for t in valid_widths(cfg) if chips % t == 0]:
        data = chips // tp
        try:
            report = size(cfg, tp=tp, chips_per_slice=chips, **size_args)
        except SizingError as e:
            rows.append(Split(data, tp, None, f"does not fit: {str(e).split(';')[0]}"))
            continue
        why = None
        hosts = max(1, chips // chips_per_host)
        if data > 1 and (tp > chips_per_host or data % hosts):
            why = "several engines that each span hosts: not supported"
        rows.append(Split(data, tp, report, why))
    runnable = [r for r in rows if r.why_not is None]
    if runnable:
        best = max(runnable, key=lambda r: (r.report.decode_tokens_per_s_per_slice, -r.model))
        rows = [Split(r.data, r.model, r.report, r.why_not, r is best) for r in rows]
    return rows


def format_table(rows: list[Split], *, chips: int, chips_per_host: int, chip: str | None) -> str:
    gib = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
    first = next((r.report for r in rows if r.report), None)
    head = f"splits of {chips} {chip + ' ' if chip else ''}chips ({chips_per_host} a host)"
    if first is not None:
        head += (f" for {first.model} ({first.dtype}), {first.prompt_tokens} prompt + {first.new_tokens} new tokens "
                 f"a sequence")
    lines = [head, "   cluster.mesh          weights GiB/chip  KV bytes/token/chip  max_pages/engine  seqs fit/engine  "
                   "max_seqs  decode bound tokens/s/slice"]
    for r in rows:
        mesh = f"{{data: {r.data}, model: {r.model}}}"
        mark = "*" if r.best else " "
        if r.report is None:
            lines.append(f" {mark} {mesh:<20}  {r.why_not}")
            continue
        p = r.report
        lines.append(f" {mark} {mesh:<20}  {gib(p.weight_bytes_per_chip):>16}  {p.kv_bytes_per_token_per_chip:>19,}  "
                     f"{p.max_pages:>16,}  {p.seqs_that_fit:>15,}  {p.max_seqs:>8}  "
                     f"{p.decode_tokens_per_s_per_slice:>27,.0f}" + (f"  ({r.why_not})" if r.why_not else ""))
    best = next((r for r in rows if r.best), None)
    lines.append(f"* best: cluster.mesh {{data: {best.data}, model: {best.model}}} (the highest decode bound of the "
                 f"splits that run); `--tp {best.model}` prints its engine capacities" if best else
                 "no split of this slice can run the model; use more chips or a chip with more HBM")
    return "\n".join(lines)
