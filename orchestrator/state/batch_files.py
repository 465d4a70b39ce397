"""Reading batches/<id>.parquet: the slice that runs a batch reads its prompts (the head sends a reference,
`BatchWork`), and the head reads only its prompt ids, to check and stamp the samples that come back.

Local paths and gs:// URLs alike (parquet_io: ranged reads of the footer and columns). A slice host needs the run
directory: a gs:// URL, or a path that every machine running a slice mounts.
"""

from __future__ import annotations

import engine as lazy_engine  # its multi-host names load JAX on first use, on a slice's host, never in the head
from orchestrator.state.rundir import RunDir
from orchestrator.storage import location, parquet_io, storage


class BatchFileError(Exception):
    """A batch file that cannot be read. `deterministic`: missing or unreadable (a damaged plan), so every attempt
    would fail alike; otherwise the hosts of a multi-host slice read different outcomes."""

    def __init__(self, message: str, deterministic: bool = True) -> None:
        super().__init__(message)
        self.deterministic = deterministic


class RunDirUnreachable(ValueError):
    """A slice host cannot see the run directory's batches/: a configuration error, found at slice start."""


def read_batch(path, columns: list[str] | None = None):
    """The batch file's table (or `columns` of it); raises BatchFileError naming the file and the fix."""
    path = str(path)
    try:
        return parquet_io.read_parquet(path, columns=columns)
    except Exception as e:  # noqa: BLE001 - a bad batch file fails its batch, not the run
        what = "is missing" if isinstance(e, FileNotFoundError) else f"cannot be read ({e})"
        manifest = RunDir(location.location(path).parent.parent).manifest
        raise BatchFileError(f"{path} {what}; the plan is damaged: remove {manifest} and rerun to re-plan "
                             "(outputs already written are adopted)") from None


def prefetch(path: str):
    """`read_batch`'s table, or the BatchFileError it raised (to be raised where the batch enters the engine): a
    slice reads a batch as it arrives, off the engine's thread, while the engine runs the batches before it."""
    try:
        return read_batch(path)
    except BatchFileError as e:
        return e


def on_hosts(loaded, path: str, batch_id: str, spmd: bool):
    """The prefetched table (raising the prefetch's error). On a multi-host SPMD slice every host read the file
    and the hosts first agree on the outcome (one small collective, on the engine's thread), so a host that
    could not read it cannot leave the others waiting in a step; what they read is compared with the requests
    (Engine)."""
    error = loaded if isinstance(loaded, BatchFileError) else None
    if spmd:
        try:
            lazy_engine.hosts_agree({"batch_file": f"{batch_id}: {'unreadable' if error else 'read'}"})
        except lazy_engine.HostsDisagree as e:
            raise BatchFileError(f"{path}: {e}", deterministic=False) from None
    if error is not None:
        raise error
    return loaded


def check_reachable(batches_dir: str, slice_name: str) -> None:
    """Raise RunDirUnreachable unless this host sees the run directory's batches/."""
    if not storage.exists(batches_dir):
        import socket

        raise RunDirUnreachable(
            f"{slice_name} on {socket.gethostname()} cannot see {batches_dir}: slices read their batches from the "
            "run directory, so set run_dir to a gs:// URL or to a path that every machine running a slice mounts")
