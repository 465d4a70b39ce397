"""`pagefleet serve` against a real Ray Serve on loopback: runs end to end, cancel and resume, auth, bad input, fuzz."""

import os
import socket
import stat
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from engine import output_record
from orchestrator.export.export import RECORD_FIELDS, collect
from orchestrator.commands.serve import main as serve_main
from orchestrator.service.service_auth import resolve_token

from ..conftest import write_run_corpus

pytestmark = pytest.mark.ray

TOKEN = "test-token-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(ray_local, tmp_path_factory):
    """One Serve instance for the module, on a free loopback port; (url, runs_root)."""
    from ray import serve

    from orchestrator.service.service import ServiceConfig, service_app

    runs_root = tmp_path_factory.mktemp("runs")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(service_app(ServiceConfig(runs_root=str(runs_root), max_body_bytes=64 * 1024), TOKEN),
              name="pagefleet-test", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while requests.get(f"{url}/runs", headers=AUTH, timeout=10).status_code != 200:
        assert time.time() < deadline, "the service did not come up"
        time.sleep(0.5)
    yield url, runs_root
    serve.shutdown()


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def config(name: str, model: str, corpus: str, **sampling) -> dict:
    """Small, quick settings (as tests/orchestrator/conftest.run_args) as a config mapping; one slice."""
    return {"name": name, "model": {"path": model, "dtype": "float32"}, "corpus": {"path": corpus},
            "sampling": {"max_new_tokens": 12, **sampling},
            "engine": {"max_seq_len": 128, "page_size": 8, "max_pages": 96, "max_seqs": 8, "max_seqs_in_prefill": 4,
                       "max_prefill_size": 128},
            "packing": {"max_prefill_steps": 2}, "cluster": {"num_slices": 1}, "tracker": {"type": "noop"},
            "retry": {"backoff_s": 0.05}}


def submit(url: str, cfg: dict, as_yaml: bool = False) -> requests.Response:
    if as_yaml:
        import yaml

        return requests.post(f"{url}/runs", data=yaml.safe_dump(cfg), timeout=30,
                             headers={**AUTH, "Content-Type": "application/yaml"})
    return requests.post(f"{url}/runs", json=cfg, headers=AUTH, timeout=30)


def wait_for(url: str, name: str, states: set[str], timeout_s: float = 300) -> dict:
    deadline = time.time() + timeout_s
    while True:
        r = requests.get(f"{url}/runs/{name}", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] in states:
            return body
        assert time.time() < deadline, f"run {name} still {body['state']} after {timeout_s} s: {body}"
        time.sleep(1.0)


def why(body: dict, runs_root) -> str:
    """What a run that ended otherwise than expected left: its state, error, failed batches and last events
    (pytest cuts a long dict short, and the error is what CI's log must show)."""
    events = Path(runs_root) / body["name"] / "events.log"
    tail = events.read_text().splitlines()[-12:] if events.exists() else []
    return "\n".join([f"state={body['state']} exit_code={body.get('exit_code')} error={body.get('error')}",
                      f"failed={body.get('failed')} counts={body.get('counts')}", *tail])


def all_samples(url: str, name: str, page: int = 7) -> list[dict]:
    out, offset = [], 0
    while True:
        r = requests.get(f"{url}/runs/{name}/samples", params={"offset": offset, "limit": page}, headers=AUTH,
                         timeout=60)
        assert r.status_code == 200, r.text
        rows = r.json()["samples"]
        assert len(rows) <= page
        out += rows
        if len(rows) < page:
            return out
        offset += page


def test_two_runs_at_once_finish_and_samples_page_in_corpus_order(service, run_model, tmp_path):
    url, runs_root = service
    names = ["svc-a", "svc-b"]
    for i, name in enumerate(names):
        corpus = write_run_corpus(tmp_path / f"{name}.jsonl", 18 + 4 * i, seed=10 + i)
        r = submit(url, config(name, run_model, corpus, n=2, temperature=0.7, seed=i), as_yaml=bool(i))
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "running"
    again = submit(url, config("svc-a", run_model, str(tmp_path / "svc-a.jsonl"), n=2, temperature=0.7, seed=0))
    assert again.status_code == 409 and "already running" in again.json()["detail"]

    for name in names:
        body = wait_for(url, name, {"done", "failed", "cancelled"})
        assert body["state"] == "done", why(body, runs_root)
        assert body["counts"]["done"] == body["batches"] and body["samples_done"] == 2 * body["prompts"]
        assert body["output_tokens_done"] > 0 and body["run_dir"] == str(runs_root / name)
        got = all_samples(url, name)
        expected = [output_record(r) for r in collect(runs_root / name).select(RECORD_FIELDS).to_pylist()]
        assert got == expected and len(got) == body["samples_done"]
        batches = requests.get(f"{url}/runs/{name}/batches", headers=AUTH, timeout=30).json()["batches"]
        assert len(batches) == body["batches"] and {b["status"] for b in batches} == {"done"}
    assert set(names) <= set(requests.get(f"{url}/runs", headers=AUTH, timeout=30).json()["runs"])


def test_cancel_then_resume_through_the_api(service, run_model, tmp_path):
    url, runs_root = service
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24, seed=20)
    assert submit(url, config("svc-cancel", run_model, corpus)).status_code == 202
    r = requests.post(f"{url}/runs/svc-cancel/cancel", headers=AUTH, timeout=30)
    assert r.status_code == 202 and r.json()["cancel_requested"]
    body = wait_for(url, "svc-cancel", {"done", "failed", "cancelled"})
    assert body["state"] == "cancelled" and body["exit_code"] == 130, why(body, runs_root)
    assert body["counts"]["done"] < body["batches"] and body["counts"]["running"] == 0
    assert requests.post(f"{url}/runs/svc-cancel/cancel", headers=AUTH, timeout=30).status_code == 409

    r = requests.post(f"{url}/runs/svc-cancel/resume", headers=AUTH, timeout=30)
    assert r.status_code == 202, r.text
    body = wait_for(url, "svc-cancel", {"done", "failed", "cancelled"})
    assert body["state"] == "done", why(body, runs_root)
    keys = Counter((s["prompt_id"], s["generation_index"]) for s in all_samples(url, "svc-cancel", page=1000))
    assert set(keys.values()) == {1} and len(keys) == body["prompts"] == 24
    assert "stop requested" in (runs_root / "svc-cancel" / "events.log").read_text()


def test_every_route_needs_the_token(service):
    url, _ = service
    for path in ("/runs", "/runs/svc-a", "/openapi.json", "/docs", "/no-such-route"):
        for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            r = requests.get(url + path, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert "bearer token" in r.json()["detail"]
    assert requests.post(f"{url}/runs", json={"name": "x"}, timeout=30).status_code == 401
    schema = requests.get(f"{url}/openapi.json", headers=AUTH, timeout=30)
    assert schema.status_code == 200 and "/runs/{name}/samples" in schema.json()["paths"]
    assert requests.get(f"{url}/docs", headers=AUTH, timeout=30).status_code == 200


def test_bad_input_answers_4xx_naming_the_problem(service, run_model, tmp_path):
    url, runs_root = service
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    good = config("svc-bad", run_model, corpus)

    r = submit(url, {**good, "sampling": {"temprature": 0.5}})
    assert r.status_code == 400 and "temprature" in r.json()["detail"]
    r = submit(url, {**good, "sampling": {"temprature": 0.5}}, as_yaml=True)
    assert r.status_code == 400 and "temprature" in r.json()["detail"]
    for name in ("../x", "a/b", "", ".hidden", "x" * 65, 7, None):
        r = submit(url, {**good, "name": name})
        assert r.status_code == 400 and "run name" in r.json()["detail"], (name, r.text)
    r = submit(url, {k: v for k, v in good.items() if k != "name"})
    assert r.status_code == 400 and "name is required" in r.json()["detail"]
    r = submit(url, {**good, "run_dir": "/tmp/elsewhere"})
    assert r.status_code == 400 and "run_dir" in r.json()["detail"]
    r = submit(url, {**good, "model": {"path": None}})
    assert r.status_code == 400 and "model.path" in r.json()["detail"]
    r = submit(url, {**good, "model": {"path": "/no/such/model"}})
    assert r.status_code == 400 and r.json()["detail"].startswith("model.path '/no/such/model' does not exist")
    r = submit(url, {**good, "cluster": {"num_slices": 0}})
    assert r.status_code == 400 and "num_slices" in r.json()["detail"]
    r = submit(url, {**good, "cluster": {"num_slices": 1, "devices_per_host": 3, "mesh": {"model": 3}}})
    assert r.status_code == 400 and r.json()["detail"].startswith("cluster.mesh.model=3: "), r.text  # the model's heads
    for raw in (b"[1, 2]", b"just text", b"\xff\xfe\x00", b"{", b"[" * 5000, b"a: &a [*a]", b"",
                b'{"name": "x\\ud800", "\\udb67": 1}'):  # lone surrogates: echoed back as valid UTF-8
        r = requests.post(f"{url}/runs", data=raw, headers=AUTH, timeout=30)
        assert r.status_code == 400, (raw[:20], r.status_code, r.text)
    r = requests.post(f"{url}/runs", data=b"x" * (64 * 1024 + 1), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    # Names in the path: encoded slashes and dots reach the name check (400), they never walk the file system.
    for path in ("/runs/%2E%2E%2Fx", "/runs/..%2Fx", "/runs/a%2Fb", "/runs/%2E%2E%2Fx/samples",
                 "/runs/..%2F..%2Fetc/batches", "/runs/.hidden"):
        r = requests.get(url + path, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "run name" in r.json()["detail"], (path, r.status_code, r.text)
    for verb in ("cancel", "resume"):
        r = requests.post(f"{url}/runs/..%2Fx/{verb}", headers=AUTH, timeout=30)
        assert r.status_code == 400, (verb, r.text)
        assert requests.post(f"{url}/runs/no-such-run/{verb}", headers=AUTH, timeout=30).status_code == 404
    assert requests.get(f"{url}/runs/no-such-run", headers=AUTH, timeout=30).status_code == 404
    r = requests.get(f"{url}/runs/svc-a/samples", params={"limit": 1001}, headers=AUTH, timeout=30)
    assert r.status_code == 422
    assert not (runs_root / "svc-bad").exists()


def test_fuzz_from_the_openapi_schema_never_answers_500(service):
    """Every operation, fuzzed from the served schema. POST /runs bodies always carry an unknown key, so no fuzzed
    config can start a real run; they still exercise the parser and the checks before it."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    url, _ = service
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {"POST /runs", "GET /runs/{name}/samples"}
    calls = Counter()
    for operation in operations:
        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict):
                case.body = {**case.body, "fuzz_unknown_key": 1}
            elif operation.method.upper() == "POST" and operation.path == "/runs":
                case.body = {"name": "fuzz", "fuzz_unknown_key": 1}
            case.call_and_validate(base_url=url, headers=AUTH, checks=[not_a_server_error])
            calls[operation.path] += 1

        check()
    assert sum(calls.values()) >= 100 and calls["/runs/{name}/samples"] >= 20, calls


def test_token_file_is_made_once_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEFLEET_SERVE_TOKEN", raising=False)
    path = tmp_path / "cfg" / "serve-token"
    token, source = resolve_token(None, str(path))
    assert source == str(path) and len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_token(None, str(path)) == (token, str(path))
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        resolve_token(None, str(path))
    assert resolve_token("operator-token-0123456789", str(path))[0] == "operator-token-0123456789"
    monkeypatch.setenv("PAGEFLEET_SERVE_TOKEN", "env-token-0123456789abcdef")
    assert resolve_token(None, str(path)) == ("env-token-0123456789abcdef", "$PAGEFLEET_SERVE_TOKEN")
    with pytest.raises(ValueError, match="at least 16"):
        resolve_token("short", None)


def test_serve_refuses_a_remote_address_without_the_flag():
    with pytest.raises(ValueError, match="--allow-remote"):
        serve_main(["--host", "0.0.0.0"])  # refused before Ray or Serve start


def test_a_run_planned_before_the_service_is_read_and_resumed_by_name(service, run_model, tmp_path):
    from orchestrator.config import load_run_config
    from orchestrator.plan.planner import plan

    from ..conftest import run_args

    url, runs_root = service
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=30)
    plan(load_run_config(None, run_args(run_model, corpus, runs_root / "svc-disk", "--name=svc-disk",
                                        "--cluster.num_slices=1")))
    assert "svc-disk" in requests.get(f"{url}/runs", headers=AUTH, timeout=30).json()["runs"]
    body = requests.get(f"{url}/runs/svc-disk", headers=AUTH, timeout=30).json()
    assert body["state"] == "incomplete" and body["counts"]["pending"] == body["batches"] > 0
    batches = requests.get(f"{url}/runs/svc-disk/batches", headers=AUTH, timeout=30).json()["batches"]
    assert {b["status"] for b in batches} == {"pending"}
    assert requests.get(f"{url}/runs/svc-disk/samples", headers=AUTH, timeout=30).json()["total"] == 0

    r = requests.post(f"{url}/runs/svc-disk/resume", headers=AUTH, timeout=30)  # the config comes from run.json
    assert r.status_code == 202, r.text
    body = wait_for(url, "svc-disk", {"done", "failed", "cancelled"})
    assert body["state"] == "done", why(body, runs_root)
    assert all_samples(url, "svc-disk") == [output_record(r) for r in collect(runs_root / "svc-disk").select(RECORD_FIELDS).to_pylist()]
