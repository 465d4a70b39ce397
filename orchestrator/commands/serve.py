"""`pagefleet serve`: flags, the loopback rule, the token, then Ray Serve until Ctrl-C."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from orchestrator.service.service import service_app, ServiceConfig
from orchestrator.service.service_auth import DEFAULT_TOKEN_FILE, resolve_token, TOKEN_ENV
from orchestrator.exit_codes import FAULT
from orchestrator.slices.cluster import ClusterConfig, ClusterGone, ensure_ray


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet serve", description="The HTTP control plane (Ray Serve): submit, "
                                     "watch, read, cancel and resume runs.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--allow-remote", action="store_true", help="allow binding to a non-loopback address")
    parser.add_argument("--runs-root", default="manifests", help="parent of the run directories (default manifests)")
    parser.add_argument("--token", default=None, help=f"the bearer token (or ${TOKEN_ENV}); default: the token file's")
    parser.add_argument("--token-file", default=None,
                        help=f"where the token is kept, made on first start, mode 0600 (default {DEFAULT_TOKEN_FILE})")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--data-root", action="append", default=[], metavar="DIR",
                        help="a directory runs may read corpora and models from (repeatable; default the runs root's "
                        "parent); paths are resolved (links, ..) before they are checked")
    parser.add_argument("--allow-url", action="append", default=[], metavar="SCHEME://BUCKET",
                        help="a bucket runs may read from, e.g. gs://my-bucket (repeatable); other URLs are refused")
    args = parser.parse_args(argv)
    if not is_loopback(args.host) and not args.allow_remote:
        raise ValueError(f"--host {args.host} is not a loopback address: the API starts and cancels runs, so exposing "
                         "it is opt-in; pass --allow-remote (and put TLS in front of it), or bind 127.0.0.1")

    from ray import serve

    token, source = resolve_token(args.token, args.token_file)
    cfg = ServiceConfig(runs_root=os.path.abspath(args.runs_root), max_body_bytes=args.max_body_bytes,
                        workdir=os.getcwd(), data_roots=tuple(os.path.abspath(d) for d in args.data_root),
                        allow_urls=tuple(args.allow_url))
    policy = cfg.policy()  # a malformed --allow-url is refused here, before Ray starts
    try:
        ensure_ray(ClusterConfig())
    except ClusterGone as e:
        print(f"pagefleet serve: {e}", file=sys.stderr)
        return FAULT
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(service_app(cfg, token), name="pagefleet", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"pagefleet serve: {url} (OpenAPI schema {url}/openapi.json, docs {url}/docs)")
    print(f"runs under {cfg.runs_root}; bearer token from {source}")
    print(f"runs may read under {', '.join(str(r) for r in policy.roots)}"
          + (f" and from {', '.join(f'{s}://{b}' for s, b in policy.urls)}" if policy.urls else "; no URLs"))
    print("send `Authorization: Bearer <token>` with every request; Ctrl-C stops the service (runs stay resumable)")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` and process managers stop it like Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("pagefleet serve: stopping")
    finally:
        serve.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
