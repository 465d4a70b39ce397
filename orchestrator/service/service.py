"""`pagefleet serve`: the Ray Serve control plane. Submit, watch, read, cancel and resume runs over HTTP.

One FastAPI ingress deployment (num_cpus=0, so the slices get the CPUs) holds the RunRegistry; each
run is a background thread in the replica running the same Driver as `pagefleet run`, which creates
its own slice actors on the same Ray cluster. Every route, the OpenAPI schema and the docs included,
needs the bearer token (service_auth.BearerAuth). Errors are JSON `{"detail": ...}`: 400 for a bad
config or name (a path outside the data roots, a URL not allowed, a value of the wrong type, aliases that
expand too far), 404 for an unknown run, 409 for a conflict, 413 for a body over the limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from ray import serve

from orchestrator.config import ConfigError
from orchestrator.service.service_auth import BearerAuth, token_digest
from orchestrator.service.service_paths import DataPolicy
from orchestrator.service.service_runs import RunConflict, RunNameError, RunRegistry, UnknownRun, check_name, parse_run_config
from orchestrator.state.manifest import CorruptRunFile

MAX_OFFSET = 10**12


@dataclass(frozen=True)
class ServiceConfig:
    runs_root: str = "manifests"
    """Parent of every run directory: a run named N lives in <runs_root>/N (resolved to an absolute path)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (POST /runs); larger answers 413."""
    max_page: int = 1000
    """Most samples one GET /runs/{name}/samples returns (`limit`)."""
    workdir: str | None = None
    """Directory the replica resolves relative paths in run configs against (where `pagefleet serve` started)."""
    data_roots: tuple[str, ...] = ()
    """Directories under which corpus and model paths must lie (after resolving links and `..`); empty means the
    runs root's parent."""
    allow_urls: tuple[str, ...] = ()
    """`scheme://bucket` URLs runs may read (e.g. gs://my-bucket); any other URL in a config is refused."""

    def policy(self) -> DataPolicy:
        """What runs may read, with relative paths resolved against workdir (else the current directory)."""
        base = self.workdir or os.getcwd()
        roots = self.data_roots or (str(Path(self.runs_root if os.path.isabs(self.runs_root)
                                             else os.path.join(base, self.runs_root)).resolve().parent),)
        return DataPolicy.build(roots, self.allow_urls, base)


class BodyTooLarge(Exception):
    """The request body is over ServiceConfig.max_body_bytes (HTTP 413)."""


_ERRORS: dict[type[Exception], int] = {ConfigError: 400, RunNameError: 400, UnknownRun: 404, RunConflict: 409,
                                       CorruptRunFile: 409, BodyTooLarge: 413}
"""CorruptRunFile: a run whose files cannot be read as written (the detail names the file and the fix)."""

_CONFIG_BODY = {"requestBody": {"required": True, "description": "A run config (the keys of docs/config.md) as JSON or "
                                "YAML; `name` is required and `run_dir` is set by the service.", "content": {
    "application/json": {"schema": {"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string"}}, "additionalProperties": True}},
    "application/yaml": {"schema": {"type": "string"}}}}}


def build_app(registry: RunRegistry, token_sha256: str, cfg: ServiceConfig) -> FastAPI:
    """The HTTP API over `registry`; every route needs the token whose SHA-256 is `token_sha256`."""
    app = FastAPI(title="pagefleet", version="1", description=__doc__)
    app.add_middleware(BearerAuth, token_sha256=token_sha256)

    for error, code in _ERRORS.items():
        app.add_exception_handler(error, lambda request, e, code=code: JSONResponse({"detail": _text(e)}, code))
    app.add_exception_handler(Exception, lambda request, e: JSONResponse(
        {"detail": f"internal error: {type(e).__name__}: {_text(e)}"}, 500))

    @app.post("/runs", status_code=202, openapi_extra=_CONFIG_BODY, summary="Submit a run config; start it")
    async def submit(request: Request) -> dict[str, Any]:
        body = await _read_body(request, cfg.max_body_bytes)
        run_cfg = parse_run_config(body, registry.root, cfg.max_body_bytes)
        return registry.submit(run_cfg)

    @app.get("/runs", summary="Runs of this service and under its runs root")
    def list_runs() -> dict[str, Any]:
        return {"runs": registry.names()}

    # Names are path-typed so that a decoded '/' (`..%2Fx`) reaches check_name and answers 400, not 404;
    # the routes with a suffix come first so that `/runs/x/batches` is not read as a run named `x/batches`.
    @app.get("/runs/{name:path}/batches", summary="The run's manifest records (batches.jsonl)")
    def batches(name: str) -> dict[str, Any]:
        return {"name": name, "batches": registry.batches(check_name(name))}

    @app.get("/runs/{name:path}/samples", summary="Samples of the done batches in corpus order, a page at a time")
    def samples(name: str, offset: int = Query(0, ge=0, le=MAX_OFFSET),
                limit: int = Query(100, ge=1, le=cfg.max_page)) -> dict[str, Any]:
        return registry.samples(check_name(name), offset, limit)

    @app.post("/runs/{name:path}/cancel", status_code=202, summary="Stop the run; it stays resumable")
    def cancel(name: str) -> dict[str, Any]:
        return registry.cancel(check_name(name))

    @app.post("/runs/{name:path}/resume", status_code=202, summary="Start the run again with its config")
    def resume(name: str) -> dict[str, Any]:
        return registry.resume(check_name(name))

    @app.get("/runs/{name:path}", summary="State, counts per status, tokens, throughput, ETA")
    def describe(name: str) -> dict[str, Any]:
        return registry.describe(check_name(name))

    return app


def _text(e: Exception) -> str:
    """The message as valid UTF-8: input echoed back may hold lone surrogates (JSON `\\ud800`)."""
    return str(e).encode("utf-8", "backslashreplace").decode("utf-8")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge(f"request body over {limit:,} bytes; a run config is a few KiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body over {limit:,} bytes; a run config is a few KiB")
        chunks.append(chunk)
    return b"".join(chunks)


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1)
@serve.ingress()
class ServiceIngress:
    """The one replica: owns the registry (so every run's thread); the app is built at replica start."""

    def __init__(self, cfg: ServiceConfig, token_sha256: str) -> None:
        if cfg.workdir and os.path.isdir(cfg.workdir):
            os.chdir(cfg.workdir)  # relative corpus and model paths mean what they mean to `pagefleet run` there
        self.cfg = cfg
        self.token_sha256 = token_sha256
        self.registry = RunRegistry(cfg.runs_root, cfg.policy())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.registry, self.token_sha256, self.cfg)

    def __del__(self) -> None:
        self.registry.stop_all()


def service_app(cfg: ServiceConfig, token: str) -> serve.Application:
    """The Serve application to `serve.run`; only the token's digest is passed to the replica."""
    return ServiceIngress.bind(cfg, token_digest(token))
