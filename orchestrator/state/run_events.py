"""What the head's run loop reports as it happens: typed events, written to events.log by the head and open to
any subscriber (`Driver.events`: a test that acts once every slice is up, a service that shows slice starts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SliceStarted:
    """Every host of a slice has loaded the model and started its engines."""

    slice: str
    pids: tuple[int, ...]
    """The slice's host processes, in host order."""
    devices: int
    engines: int
    """Independent engines in the slice (cluster.mesh.data)."""
    processes: tuple[int, ...]
    """Each host's JAX process count: 1 on every host when the hosts are independent (host-level parallelism)."""
    load_s: float
    model_bytes_read: int
    pod_slice: str | None
    modules: tuple[str, ...]
    """What the slice's processes imported to get there (the head alone imports the tracker, for one)."""

    @classmethod
    def from_info(cls, name: str, info: dict) -> SliceStarted:
        return cls(name, tuple(info["pids"]), info["devices"], info.get("engines", 1), tuple(info.get("processes", ())),
                   info["load_s"], info.get("model_bytes_read", 0), info.get("pod_slice"), tuple(info.get("modules", ())))

    def line(self) -> str:
        where = f", pod_slice {self.pod_slice}" if self.pod_slice else ""
        read = f", {self.model_bytes_read:,} bytes read from the bucket" if self.model_bytes_read else ""
        where += f", {self.engines} data-parallel engines" if self.engines > 1 else ""
        where += ", each host its own JAX process" if len(self.processes) > 1 and max(self.processes) == 1 else ""
        return (f"{self.slice} ready (pids {list(self.pids)}, {self.devices} devices{where}, "
                f"model loaded in {self.load_s:.1f} s{read})")


@dataclass(frozen=True)
class ReadySlice:
    name: str
    pids: tuple[int, ...]
    """Its host processes, in host order."""
    batches: tuple[str, ...]
    """The batches running there at that moment, in the order they were sent."""


@dataclass(frozen=True)
class SlicesReady:
    """Every live slice has started, the first time in a run that this holds; the first batches are already sent."""

    slices: tuple[ReadySlice, ...]
    after_s: float
    """Seconds since the run loop began."""

    def line(self) -> str:
        held = sum(len(s.batches) for s in self.slices)
        return f"all {len(self.slices)} slices ready {self.after_s:.1f} s after the run started, holding {held} batches"


RunEvent = SliceStarted | SlicesReady


class EventStream:
    """Subscribers are called in the head's loop, in order, with each event as it happens."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[RunEvent], None]] = []

    def subscribe(self, subscriber: Callable[[RunEvent], None]) -> Callable[[], None]:
        """Call `subscriber` with every later event; returns the call that ends the subscription."""
        self._subscribers.append(subscriber)
        return lambda: self._subscribers.remove(subscriber)

    def emit(self, event: RunEvent) -> None:
        for subscriber in list(self._subscribers):
            subscriber(event)
