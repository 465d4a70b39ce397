"""The service's runs: name -> (config, thread, stop event, outcome), and what a request may ask of them.

Each run executes in one background thread of the Serve replica as `Driver(cfg, stop=event).run()`;
cancelling sets the event, so the driver stops and leaves the run resumable. A run's directory is
always `<runs_root>/<name>` (the service sets `run_dir`; a config that names another is refused), so
a run directory made before the service started is found, read and resumed by its name. The run
directories are the truth; the registry only adds what a live thread knows (its outcome or error).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config import ConfigError, RunConfig, load_run_config, plan_changes
from orchestrator.export.export import done_outputs, page
from orchestrator.observe.status import head_holding, status
from orchestrator.run.driver import Driver, RunOutcome
from orchestrator.service.service_body import BodyTooLargeWhenExpanded, load_body
from orchestrator.service.service_paths import DataPolicy
from orchestrator.slices.slice_layout import validate
from orchestrator.state.manifest import read_manifest
from orchestrator.state.rundir import RunDir
from orchestrator.surface import surface

log = logging.getLogger(__name__)

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME_RULE = ("a run name is 1 to 64 characters: letters, digits, '.', '_' and '-', starting with a letter or digit "
             f"({NAME_PATTERN})")
_NAME = re.compile(NAME_PATTERN)


class RunNameError(ValueError):
    """A name that breaks NAME_RULE (HTTP 400)."""


class UnknownRun(LookupError):
    """No such run in the registry or under the runs root (HTTP 404)."""


class RunConflict(RuntimeError):
    """The run is running, or its directory holds another plan (HTTP 409)."""


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name)[:80]
        raise RunNameError(f"invalid run name {shown}: {NAME_RULE}")
    return name


def parse_run_config(body: bytes, runs_root: Path, max_expanded_bytes: int) -> RunConfig:
    """A run config from a YAML or JSON body, loaded as strictly as `pagefleet run` loads a file; run_dir set.

    Aliases may not expand the body beyond `max_expanded_bytes` of text (service_body.load_body), and every
    value must have its key's type (load_run_config: a `sampling.stop` entry is a string, never a printed list).
    Errors name body keys (orchestrator.surface), not command-line flags.
    """
    with surface("http"):
        return _parse_run_config(body, runs_root, max_expanded_bytes)


def _parse_run_config(body: bytes, runs_root: Path, max_expanded_bytes: int) -> RunConfig:
    try:
        text = body.decode("utf-8")
        data = load_body(text, max_expanded_bytes)
    except BodyTooLargeWhenExpanded as e:
        raise ConfigError(str(e)) from None
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"the body is not a YAML or JSON run config: {str(e)[:300]}") from None
    if not isinstance(data, dict):
        raise ConfigError("the body must be a YAML or JSON mapping of run config keys (docs/config.md), "
                          f"got {type(data).__name__}")
    if "name" not in data:
        raise ConfigError("name is required: the service keys runs by name (its run directory is <runs-root>/<name>)")
    name = check_name(data["name"])
    run_dir = runs_root / name
    if data.get("run_dir") not in (None, str(run_dir)):
        raise ConfigError(f"run_dir is set by the service to <runs-root>/<name> ({run_dir}); leave run_dir out")
    with tempfile.NamedTemporaryFile("wb", suffix=".yaml") as f:
        f.write(body)  # the bytes as sent (valid UTF-8), even when they escape lone surrogates
        f.flush()
        try:
            cfg = load_run_config(f.name, [])
        except ConfigError as e:
            raise ConfigError(str(e).replace(f.name, "config")) from None
        except Exception as e:  # noqa: BLE001 - whatever draccus makes of odd input is the input's fault
            raise ConfigError(f"config: {type(e).__name__}: {str(e)[:300]} "
                              "(keys in docs/config.md)") from None
    try:
        cfg.model.require_path()  # set, and a directory (or a cached Hub id) here, where runs start
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(cfg, run_dir=str(run_dir))


@dataclass
class _Run:
    cfg: RunConfig
    stop: threading.Event
    thread: threading.Thread
    started_at: float
    outcome: RunOutcome | None = None
    error: str | None = None
    """Why the run could not start or crashed (an exception in the head), else None."""
    finished_at: float | None = None


class RunRegistry:
    """The runs this replica started, plus those found under `runs_root` by name."""

    def __init__(self, runs_root: str | Path, policy: DataPolicy) -> None:
        self.root = Path(runs_root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.policy = policy
        """What a run may read; every config is checked against it before it starts (submit and resume)."""
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()

    def run_dir(self, name: str) -> RunDir:
        """The run's directory: a real directory directly under the runs root, never one reached through a link
        (a link there would put the run's writes wherever it points)."""
        path = self.root / check_name(name)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise RunNameError(f"run {name}: {path} is a link or a file, not a directory; the service keeps runs only "
                               "in real directories under its runs root: remove it, or choose another name")
        return RunDir(path)

    # -- starting and stopping -------------------------------------------------------------------

    def submit(self, cfg: RunConfig) -> dict[str, Any]:
        """Start `cfg` in a background thread; it plans if needed and resumes from batches.jsonl."""
        with surface("http"):
            return self._submit(cfg)

    def _submit(self, cfg: RunConfig) -> dict[str, Any]:
        name = check_name(cfg.name)
        run_dir = self.run_dir(name)
        self.policy.check(cfg)  # before anything opens the corpus or model (PathRefused: HTTP 400)
        try:  # the head's own checks (slice_layout.validate: the mesh against the devices and the model's heads,
            validate(cfg)  # the capacities), here rather than in the run's thread: a config error is a 400
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
        with self._lock:
            current = self._runs.get(name)
            if current is not None and current.thread.is_alive():
                raise RunConflict(f"run {name} is already running; cancel it first (POST /runs/{name}/cancel)")
            holder = head_holding(run_dir)
            if holder is not None:
                raise RunConflict(f"run directory {run_dir.root} is in use by another head ({holder}); wait for it")
            if run_dir.run_json.exists():
                changed = plan_changes(run_dir.read_run_json().get("sample_affecting", {}), cfg)
                if changed:
                    raise RunConflict(f"run {name} was planned for different samples ({'; '.join(changed[:5])}); "
                                      f"resume it with its own config (POST /runs/{name}/resume) or choose a new name")
            stop = threading.Event()
            thread = threading.Thread(target=self._execute, args=(name,), name=f"pagefleet-run-{name}", daemon=True)
            self._runs[name] = _Run(cfg, stop, thread, time.time())
            thread.start()
        return self.describe(name)

    def resume(self, name: str) -> dict[str, Any]:
        """Start a known run again with its config (the registry's, else run.json's snapshot)."""
        import draccus

        run_dir = self.run_dir(name)
        with self._lock:
            known = self._runs.get(name)
        if known is not None:
            cfg = known.cfg
        elif run_dir.run_json.exists():
            cfg = draccus.decode(RunConfig, run_dir.read_run_json()["config"])
            cfg = dataclasses.replace(cfg, name=name, run_dir=str(run_dir.root))
        else:
            raise UnknownRun(f"no run named {name} (and no plan in {run_dir.root}); submit its config with POST /runs")
        return self.submit(cfg)

    def cancel(self, name: str) -> dict[str, Any]:
        with self._lock:
            run = self._runs.get(name)
        if run is None or not run.thread.is_alive():
            self.describe(name)  # 404 for an unknown name
            raise RunConflict(f"run {name} is not running in this service; nothing to cancel")
        run.stop.set()
        return self.describe(name)

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop every run (resumable) and wait up to `timeout_s` for their heads to finish."""
        with self._lock:
            runs = list(self._runs.values())
        for run in runs:
            run.stop.set()
        deadline = time.time() + timeout_s
        for run in runs:
            run.thread.join(max(0.0, deadline - time.time()))

    def _execute(self, name: str) -> None:
        run = self._runs[name]
        try:
            with surface("http"):  # the run's errors reach the caller through GET /runs/{name}
                run.outcome = Driver(run.cfg, show_progress=False, stop=run.stop).run()
        except Exception as e:  # noqa: BLE001 - a run that cannot start is reported by GET, not lost
            log.exception("run %s failed", name)
            run.error = f"{type(e).__name__}: {e}"
        finally:
            run.finished_at = time.time()

    # -- reading ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        on_disk = {p.name for p in self.root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name)
                   and (p / "run.json").exists()}
        with self._lock:
            return sorted(on_disk | set(self._runs))

    def describe(self, name: str) -> dict[str, Any]:
        """The run's state (running | done | failed | cancelled | incomplete) and `status` figures once planned."""
        run_dir = self.run_dir(name)
        with self._lock:
            run = self._runs.get(name)
        if run is None and not run_dir.run_json.exists():
            raise UnknownRun(f"no run named {name} (no plan in {run_dir.root}); GET /runs lists the runs")
        figures = status(run_dir.root) if run_dir.manifest.exists() else {"run_dir": str(run_dir.root), "counts": None}
        out: dict[str, Any] = {"name": name, "state": _state(run, figures), "planned": run_dir.manifest.exists(),
                               "cancel_requested": bool(run and run.stop.is_set()), "error": run.error if run else None,
                               "exit_code": run.outcome.exit_code if run and run.outcome else None}
        return {**out, **figures}

    def batches(self, name: str) -> list[dict[str, Any]]:
        self.describe(name)  # 404 for an unknown name
        manifest = self.run_dir(name).manifest
        return [dataclasses.asdict(r) for r in read_manifest(manifest)] if manifest.exists() else []

    def samples(self, name: str, offset: int, limit: int) -> dict[str, Any]:
        """Samples of the done batches in corpus order, then generation index: `limit` of them from `offset`."""
        self.describe(name)
        run_dir = self.run_dir(name)
        if not run_dir.manifest.exists():
            return {"name": name, "offset": offset, "limit": limit, "total": 0, "samples": []}
        total, rows = page(done_outputs(run_dir.root, partial=True), None, offset, limit)
        return {"name": name, "offset": offset, "limit": limit, "total": total, "samples": rows}


def _state(run: _Run | None, figures: dict[str, Any]) -> str:
    if run is not None:
        if run.thread.is_alive():
            return "running"
        if run.error is not None:
            return "failed"
        return {0: "done", 130: "cancelled"}.get(run.outcome.exit_code if run.outcome else 1, "failed")
    counts = figures.get("counts")
    if figures.get("head"):
        return "running"  # by another head (a `pagefleet run` outside the service)
    if counts is None:
        return "incomplete"
    if counts["done"] == sum(counts.values()):
        return "done"
    return "failed" if counts["failed"] else "incomplete"
