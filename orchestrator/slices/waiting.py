"""Slices that wait for resources: counted and said, never a silent stall.

Ray queues an actor whose resources are not free and starts it when they are; for a slice that asks
for more than the whole cluster has, that is never. The head says how many slices wait and for what,
at a few-second check and a line every progress interval (see `Driver`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

from orchestrator.observe.progress import line_every_s
from orchestrator.slices.cluster import ClusterConfig

if TYPE_CHECKING:
    from orchestrator.observe.progress import RunProgress
    from orchestrator.state.run_state import RunState

WAIT_CHECK_S = 5.0
"""How often the head checks whether slices wait for resources."""


def slice_demand(cluster: ClusterConfig) -> dict[str, float]:
    """Ray resources one slice takes (every host's request, plus the slice head resource when set)."""
    demand: dict[str, float] = {}
    for key, value in cluster.resources_per_host.items():
        if value:
            demand[key] = demand.get(key, 0.0) + value * cluster.hosts_per_slice
    if cluster.slice_head_resource:
        demand[cluster.slice_head_resource] = demand.get(cluster.slice_head_resource, 0.0) + 1
    return demand


def slices_that_fit(demand: dict[str, float], resources: dict[str, float]) -> int:
    """How many slices of `demand` the `resources` hold at once (ignoring how they split over nodes)."""
    return min((math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0), default=10**9)


def _format(resources: dict[str, float], keys) -> str:
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys)


SLOW_START_S = 60.0
"""A slice not started after this long is reported even when the cluster could hold it."""


def waiting_text(num_waiting: int, num_started: int, cluster: ClusterConfig, total: dict[str, float],
                 available: dict[str, float], waited_s: float) -> str | None:
    """One line on the slices that have not started, or None when there is nothing to say yet.

    `num_waiting`: live slices not started; `num_started`: slices running; `total` / `available`: the cluster's
    resources (ray.cluster_resources() / ray.available_resources()); `waited_s`: how long slices have been
    waiting. Slices beyond what the whole cluster holds are reported at once; others after SLOW_START_S (a
    started actor that loads its model holds its resources too, so the head cannot tell the two apart)."""
    if num_waiting <= 0:
        return None
    demand = slice_demand(cluster)
    needs = _format(demand, demand)
    num_slices = num_waiting + num_started
    never = max(0, min(num_waiting, num_slices - slices_that_fit(demand, total)))
    if never:
        return (f"{never} of {num_slices} slices wait for resources the cluster does not have ({num_started} "
                f"started): a slice needs {needs}, the cluster has {_format(total, demand)} in all; add nodes or "
                f"lower --cluster.num_slices to {num_slices - never}")
    if waited_s >= SLOW_START_S:
        return (f"{num_waiting} of {num_slices} slices not started after {waited_s:,.0f} s: a slice needs {needs}, "
                f"{_format(available, demand)} free now of {_format(total, demand)} (still loading the model, or "
                "waiting for resources that other work holds)")
    return None


class WaitingReport:
    """The head's check, every WAIT_CHECK_S: do slices wait for resources? The line goes to the progress (so
    `status` and its progress lines show it) at once, and to stderr and events.log when it starts and then once
    per progress interval while it lasts."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self._next_check = self._next_report = 0.0  # monotonic times
        self._since: float | None = None  # since when some slice has not started

    def check(self, num_waiting: int, num_live: int, progress: RunProgress, state: RunState) -> None:
        """`num_waiting` of the `num_live` slices have not started."""
        import ray

        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + WAIT_CHECK_S
        if not num_waiting:
            self._since = None
        elif self._since is None:
            self._since = now
        text = waiting_text(num_waiting, num_live - num_waiting, self.cluster, ray.cluster_resources(),
                            ray.available_resources(), now - self._since) if num_waiting else None
        progress.waiting = text
        if text is None:
            self._next_report = 0.0
        elif now >= self._next_report:
            self._next_report = now + line_every_s()
            print(f"pagefleet run: {text}", file=sys.stderr, flush=True)
            state.event(text)
