"""The transfer ledger: every byte the engine loop moves between host and device, by category.

Every device-to-host read of the runner goes through `TransferLedger.read`, and every host array a device
call copies in is declared to `TransferLedger.sending` around that call. Bytes are counted from shapes and
dtypes (`ndarray.nbytes` of what crossed): no extra read, no device sync. The large buffers (the KV pool,
the weights) stay on the device: their bytes never appear here, which the tests check by running the loop
under `jax.transfer_guard("disallow")`, where only the ledger's transfers are allowed.

The ledger holds the bytes of the device call now open; `end_call` hands them to the engine's stats (which
sum and clear them with the other per-step figures) and, with `PAGEFLEET_TRACE=transfers`, logs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import numpy as np

from engine.trace import trace_logger

if TYPE_CHECKING:
    import jax

DEVICE_TO_HOST = ("tokens", "logprobs", "steps", "logits", "stats", "swap", "prompt_logprobs")
"""Categories of device-to-host reads: sampled tokens, their logprobs, multi-step calls' per-row step counts,
scored prompt tokens (`prompt_logprobs`: each one's logprob, whether it was the argmax, its position's top tokens),
full logits (checks against a reference, not the engine's path); KV pages swapped out to the host pool (`swap`);
`stats` is reserved (device-side counters) and stays 0 until something reads it."""
HOST_TO_DEVICE = ("step_inputs", "page_tables", "sampling", "token_mask", "page_copies", "swap", "scoring")
"""Categories of host-to-device copies: a step's token ids, positions, slots and lengths; its page tables;
sampling settings, keys and stop ids; the allowed-token bitmasks of steps with structured outputs (`token_mask`,
4 bytes per 32 vocabulary entries a row); the token rows scoring prompt tokens and the tokens they score
(`scoring`); the page indices of a fork's page copy; KV pages paged back in from the host
pool and the page indices of both swap directions (`swap`)."""
DIRECTIONS = {"device_to_host": DEVICE_TO_HOST, "host_to_device": HOST_TO_DEVICE}
_UNGUARDED = nullcontext()


class TransferLedger:
    """Bytes moved by the device call now open, by category and direction (see DEVICE_TO_HOST, HOST_TO_DEVICE).

    One ledger per runner: its reads and its device calls' inputs go through it; nothing else counts them.
    """

    def __init__(self) -> None:
        import jax  # here: the reports (engine.stats, `pagefleet status`) import this module without JAX

        self._config = jax.config
        self._allow_reads = jax.transfer_guard_device_to_host
        self._allow_sends = jax.transfer_guard_host_to_device
        self._logger = trace_logger("transfers")
        self._calls = 0
        self._d2h: dict[str, int] = {}
        self._h2d: dict[str, int] = {}

    def read(self, **arrays: jax.Array) -> tuple[np.ndarray, ...]:
        """The host copies of the device arrays, in argument order, each counted under its keyword's category:
        `tokens, logprobs = ledger.read(tokens=t, logprobs=lp)`. The one device-to-host read of the engine loop:
        allowed under `jax.transfer_guard_device_to_host("disallow")`, which catches any other."""
        # Entering JAX's guard context costs about as much as the read itself: only under a guard (tests, a
        # debugging session), not in a run, where the level is unset.
        if self._config.jax_transfer_guard_device_to_host in (None, "allow"):
            host = tuple(map(np.asarray, arrays.values()))
        else:
            with self._allow_reads("allow"):
                host = tuple(map(np.asarray, arrays.values()))
        for category, h in zip(arrays, host):
            _add(self._d2h, DEVICE_TO_HOST, category, h.nbytes)
        return host

    def prefetch(self, array: jax.Array) -> None:
        """Start copying a device array to the host without waiting (a KV page-out), allowed under the guard as
        `read` is; its bytes are counted when `read` takes it."""
        if self._config.jax_transfer_guard_device_to_host in (None, "allow"):
            array.copy_to_host_async()
        else:
            with self._allow_reads("allow"):
                array.copy_to_host_async()

    def sending(self, **arrays: np.ndarray | Sequence[np.ndarray]) -> AbstractContextManager:
        """Around a device call (`with ledger.sending(...): call(...)`): counts the host arrays it copies to the
        device (each keyword a category, its value an array or a sequence of arrays) and allows that call's
        host-to-device transfers under `jax.transfer_guard_host_to_device("disallow")`. Device arrays passed to
        the call do not cross: leave them out."""
        for category, value in arrays.items():
            n = value.nbytes if isinstance(value, np.ndarray) else sum(a.nbytes for a in value)
            _add(self._h2d, HOST_TO_DEVICE, category, n)
        if self._config.jax_transfer_guard_host_to_device in (None, "allow"):
            return _UNGUARDED  # as in `read`: no guard context to enter in a run
        return self._allow_sends("allow")

    def end_call(self) -> tuple[dict[str, int], dict[str, int]]:
        """Close the device call: its (device_to_host, host_to_device) bytes by category (categories with no
        bytes left out), logged with `PAGEFLEET_TRACE=transfers`. The ledger then counts the next call."""
        d2h, h2d = self._d2h, self._h2d
        self._d2h, self._h2d = {}, {}
        self._calls += 1
        if self._logger is not None:
            self._logger.info("device call %d: device_to_host %s; host_to_device %s", self._calls,
                              _format(d2h), _format(h2d))
        return d2h, h2d


def _add(counts: dict[str, int], categories: tuple[str, ...], category: str, nbytes: int) -> None:
    if category not in categories:
        raise ValueError(f"{category!r} is not a transfer category; valid: {', '.join(categories)}")
    counts[category] = counts.get(category, 0) + nbytes


def _format(counts: Mapping[str, int]) -> str:
    total = sum(counts.values())
    return f"{total:,} B" + (f" ({', '.join(f'{c} {n:,}' for c, n in counts.items())})" if counts else "")


def counter_key(direction: str, category: str) -> str:
    """The name of one category's byte count in every report: `device_to_host_bytes_tokens`, ..."""
    return f"{direction}_bytes_{category}"


def transfer_counters(d2h: Mapping[str, int], h2d: Mapping[str, int]) -> dict[str, int]:
    """The categories with bytes, under their report names (a timeline line: only what it moved)."""
    return {counter_key(direction, c): n for direction, counts in (("device_to_host", d2h), ("host_to_device", h2d))
            for c, n in counts.items() if n}


def sum_transfer_counters(lines: Iterable[Mapping]) -> tuple[dict[str, int], dict[str, int]]:
    """(device_to_host, host_to_device) bytes by category summed over lines holding `transfer_counters`."""
    lines = list(lines)
    return tuple({c: sum(line.get(counter_key(direction, c), 0) for line in lines) for c in categories}
                 for direction, categories in DIRECTIONS.items())  # type: ignore[return-value]


def transfer_summary(d2h: Mapping[str, int], h2d: Mapping[str, int], generated_tokens: int) -> dict[str, float]:
    """The ledger's figures under the names every report uses (generate's summary and --stats_output, the
    run's summary and W&B, `pagefleet status`): per direction the total bytes, the bytes of every category
    (0 for one that moved none) and the bytes per generated token (0 with no token)."""
    out: dict[str, float] = {}
    for direction, counts in (("device_to_host", d2h), ("host_to_device", h2d)):
        total = sum(counts.values())
        out[f"{direction}_bytes"] = total
        out.update({counter_key(direction, c): counts.get(c, 0) for c in DIRECTIONS[direction]})
        out[f"{direction}_bytes_per_token"] = total / generated_tokens if generated_tokens else 0.0
    return out
