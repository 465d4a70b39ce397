"""Fault matrix, issue 26 items 1, 2 and 4: what a user sees when a run directory holds another plan's outputs,
and when a token holder asks the service to read what it should not, or sends a config that swells or mistypes.

Each case asserts the user-facing answer (exit status or HTTP status, and one line naming the file or key) and,
for foreign outputs, that the export is complete and exact after the documented recovery.
"""

import http.server
import json
import os
import shutil
import tempfile
import threading
import time

import pytest
import requests

from orchestrator.commands.cli import main
from orchestrator.config import load_run_config
from orchestrator.exit_codes import FAULT, OK
from orchestrator.export.export import collect
from orchestrator.state.output_plan import PLAN_KEY, PROMPT_IDS_KEY
from orchestrator.service.service_paths import DataPolicy, PathRefused

from ..conftest import run_args, write_run_corpus
from .test_driver import reference, samples
from ..service.test_service import AUTH, TOKEN, config, free_port, submit

pytestmark = pytest.mark.ray


# -- item 2: outputs carry their plan ------------------------------------------------------------


def run(config_file, model, corpus, run_dir, *extra) -> int:
    return main(["run", str(config_file), *run_args(model, corpus, run_dir, "--cluster.num_slices=1",
                                                    "--sampling.temperature=0.8", *extra)])


def test_foreign_outputs_are_refused_then_recomputed_after_the_documented_fix(ray_local, run_model, tmp_path, capsys):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=40)
    other_corpus = write_run_corpus(tmp_path / "other.jsonl", 16, seed=41)
    config_file = tmp_path / "run.yaml"
    config_file.write_text("name: foreign\n")
    run_dir = tmp_path / "run"
    assert run(config_file, run_model, corpus, run_dir, "--sampling.seed=0") == OK
    first = samples(run_dir)
    outputs = sorted((run_dir / "outputs").glob("*.parquet"))
    import pyarrow.parquet as pq

    meta = pq.read_schema(outputs[0]).metadata
    assert PLAN_KEY in meta and PROMPT_IDS_KEY in meta  # every output records its plan and its prompts

    # run.json removed, the same config again: the outputs prove their plan and are adopted, nothing is recomputed.
    (run_dir / "run.json").unlink()
    stamps = {p.name: p.stat().st_mtime_ns for p in outputs}
    capsys.readouterr()
    assert run(config_file, run_model, corpus, run_dir, "--sampling.seed=0") == OK
    assert "nothing to compute" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in outputs} == stamps and samples(run_dir) == first

    # run.json removed, then another seed, or another corpus: refused before any work, one line naming the fix.
    for extra, data in ((("--sampling.seed=1",), corpus), ((), other_corpus)):
        (run_dir / "run.json").unlink(missing_ok=True)
        capsys.readouterr()
        assert run(config_file, run_model, data, run_dir, *extra) == FAULT
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert str(outputs[0]) in err and "not computed for this plan" in err
        assert "new run directory" in err and f"remove {run_dir / 'outputs'}" in err
        assert {p.name: p.stat().st_mtime_ns for p in outputs} == stamps  # the old samples are left alone

    # The documented recovery: remove outputs/ and run again. The export is the new plan's, complete and exact.
    shutil.rmtree(run_dir / "outputs")
    assert run(config_file, run_model, corpus, run_dir, "--sampling.seed=1") == OK
    cfg = load_run_config(config_file, run_args(run_model, corpus, run_dir, "--cluster.num_slices=1",
                                                "--sampling.temperature=0.8", "--sampling.seed=1"))
    got = samples(run_dir)
    assert got == reference(run_model, run_dir, cfg) and got != first
    assert collect(run_dir).num_rows == 16


# -- items 1 and 4: the service ------------------------------------------------------------------


@pytest.fixture(scope="module")
def confined_service(ray_local, tmp_path_factory):
    """A service whose data root is this session's temporary directory; (url, runs_root, data_root)."""
    from ray import serve

    from orchestrator.service.service import ServiceConfig, service_app

    data_root = tmp_path_factory.getbasetemp()
    runs_root = tmp_path_factory.mktemp("confined-runs")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = ServiceConfig(runs_root=str(runs_root), max_body_bytes=64 * 1024, data_roots=(str(data_root),),
                        allow_urls=("gs://allowed-bucket",), workdir=str(data_root))  # relative paths: under a root
    serve.run(service_app(cfg, TOKEN), name="pagefleet-faults", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while requests.get(f"{url}/runs", headers=AUTH, timeout=10).status_code != 200:
        assert time.time() < deadline, "the service did not come up"
        time.sleep(0.5)
    yield url, runs_root, data_root
    serve.shutdown()


@pytest.fixture
def secret_outside():
    """A private credentials file outside every data root (as ~/.config/... would be)."""
    directory = tempfile.mkdtemp(prefix="pagefleet-secret-")
    path = os.path.join(directory, "creds.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(json.dumps({"api_key": "SECRET-VALUE-123"}) + "\n")
    yield path
    shutil.rmtree(directory)


class _Counting(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802 - the standard library's name
        type(self).hits += 1
        body = json.dumps({"id": "x", "prompt": "hello"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def one_line_400(response: requests.Response, key: str) -> str:
    assert response.status_code == 400, (response.status_code, response.text)
    detail = response.json()["detail"]
    assert len(detail.splitlines()) == 1 and key in detail, detail
    return detail


def test_service_reads_only_under_its_data_roots(confined_service, run_model, tmp_path, secret_outside):
    url, runs_root, data_root = confined_service
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    good = config("confined", run_model, corpus)

    # A secret outside the roots, directly or through a link that lives inside a root: 400 naming the key.
    r = submit(url, {**good, "corpus": {"path": secret_outside, "id_field": "api_key"}})
    detail = one_line_400(r, "corpus.path")
    assert "data roots" in detail and "SECRET-VALUE" not in detail
    os.symlink(secret_outside, tmp_path / "innocent.json")
    one_line_400(submit(url, {**good, "corpus": {"path": str(tmp_path / "innocent.json")}}), "corpus.path")
    one_line_400(submit(url, {**good, "corpus": {"path": str(tmp_path)}}), "corpus.path")  # a directory holding it
    dotted = f"{tmp_path}/{os.path.relpath(secret_outside, tmp_path)}"  # .. out of a root
    one_line_400(submit(url, {**good, "corpus": {"path": dotted}}), "corpus.path")
    one_line_400(submit(url, {**good, "model": {"path": os.path.dirname(secret_outside)}}), "model.path")
    one_line_400(submit(url, {**good, "model": {"path": run_model, "tokenizer": "/etc"}}), "model.tokenizer")

    # A URL is never fetched: refused with 400 naming the key, unless the operator allowed its bucket.
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        for key, body in (("corpus.path", {**good, "corpus": {"path": f"http://127.0.0.1:{port}/x.json"}}),
                          ("model.path", {**good, "model": {"path": f"http://127.0.0.1:{port}/m"}}),
                          ("corpus.path", {**good, "corpus": {"path": f"file://{secret_outside}"}}),
                          ("corpus.path", {**good, "corpus": {"path": "gs://another-bucket/x.jsonl"}}),
                          ("corpus.path", {**good, "corpus": {"path": f"simplecache::http://127.0.0.1:{port}/x"}})):
            one_line_400(submit(url, body), key)
        time.sleep(1.0)
        server.shutdown()
    assert _Counting.hits == 0
    # The local file system in fsspec's other spellings: resolved as the planner opens them, not as relative paths
    # under the working directory (which lies under a root here).
    for spelling in (f"file:{secret_outside}", f"local:{secret_outside}", f"file://{secret_outside}",
                     "file:~/pagefleet-creds.jsonl"):
        one_line_400(submit(url, {**good, "corpus": {"path": spelling}}), "corpus.path")
    assert not (runs_root / "confined").exists()
    # What the operator allowed passes the same check (no network here, so it is checked without a run).
    policy = DataPolicy.build([str(data_root)], ["gs://allowed-bucket"], str(tmp_path))
    policy.check(load_run_config(None, [f"--model.path={run_model}", "--corpus.path=gs://allowed-bucket/c/*.jsonl"]))
    with pytest.raises(PathRefused, match="corpus.path"):
        policy.check(load_run_config(None, [f"--model.path={run_model}", "--corpus.path=gs://allowed-bucketx/c"]))


def test_a_hub_id_must_resolve_under_a_data_root(run_model, tmp_path, monkeypatch):
    """A model path that is no local directory is a Hub id to the planner, read from the local Hub cache: its
    snapshot, not the id's spelling, must lie under a root."""
    cache = tmp_path / "outside" / "hub"
    snapshot = cache / "models--org--secret" / "snapshots" / ("0" * 40)
    shutil.copytree(run_model, snapshot)
    (cache / "models--org--secret" / "refs").mkdir()
    (cache / "models--org--secret" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    root = tmp_path / "root"
    root.mkdir()
    policy = DataPolicy.build([str(root)], [], str(root))
    with pytest.raises(PathRefused, match="model.path 'org/secret': its Hub cache snapshot resolves outside"):
        policy.check(load_run_config(None, ["--model.path=org/secret", f"--corpus.path={root}"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))  # the same snapshot under the root passes
    shutil.copytree(cache, root / "hub")
    policy.check(load_run_config(None, ["--model.path=org/secret", f"--corpus.path={root}"]))


def test_a_link_in_the_runs_root_is_no_run_directory(confined_service, run_model, tmp_path):
    url, runs_root, _ = confined_service
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, runs_root / "evil")
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    detail = one_line_400(submit(url, config("evil", run_model, corpus)), "evil")
    assert "link" in detail
    r = requests.get(f"{url}/runs/evil", headers=AUTH, timeout=30)
    assert r.status_code == 400, (r.status_code, r.text)
    assert list(elsewhere.iterdir()) == []


def test_bad_path_text_and_corrupt_run_files_are_4xx_naming_them(confined_service, run_model, tmp_path):
    """A NUL byte or an unpaired surrogate in a path is 400 (it was a 500 from realpath); a run whose run.json
    does not parse is 409 naming the file (it was a 500)."""
    url, runs_root, _ = confined_service
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    for bad in (f"{corpus}\x00.jsonl", f"{tmp_path}/\ud800.jsonl"):
        detail = one_line_400(submit(url, config("badpath", run_model, bad)), "corpus.path")
        assert "not a path" in detail
        one_line_400(submit(url, {**config("badpath", run_model, corpus), "model": {"path": bad}}), "model.path")
    (runs_root / "corrupt").mkdir()
    (runs_root / "corrupt" / "run.json").write_text('{"config": ')
    r = requests.post(f"{url}/runs/corrupt/resume", headers=AUTH, timeout=30)
    assert r.status_code == 409, (r.status_code, r.text)
    assert "run.json" in r.json()["detail"] and len(r.json()["detail"].splitlines()) == 1


def test_service_refuses_alias_bombs_and_mistyped_stop_strings(confined_service, run_model, tmp_path):
    url, runs_root, _ = confined_service
    corpus = str(tmp_path / "not-yet-written.jsonl")  # nothing is read: the config is refused before that
    head = (f"name: bomb\nmodel: {{path: '{run_model}'}}\ncorpus: {{path: '{corpus}'}}\ntracker: {{type: noop}}\n"
            "sampling:\n  stop: [&a0 [" + ",".join(["'" + "x" * 40 + "'"] * 8) + "], ")
    bomb = head + ", ".join(f"&a{i} [" + ",".join([f"*a{i - 1}"] * 8) + "]" for i in range(1, 6)) + "]\n"
    assert len(bomb.encode()) < 1000  # under a KiB of YAML, some 10 MB of stop strings once expanded
    r = requests.post(f"{url}/runs", data=bomb.encode(), headers={**AUTH, "Content-Type": "application/yaml"},
                      timeout=30)
    detail = one_line_400(r, "aliases")
    assert "expands" in detail
    assert not (runs_root / "bomb").exists()

    # A stop entry is a string: a list, a number or a mapping is refused, never turned into its printed form.
    for stop, key in (([["a", "b"]], "sampling.stop[0]"), (["ok", 3], "sampling.stop[1]"), ([{"a": "b"}], "sampling.stop[0]"),
                      ("just-text", "sampling.stop")):
        for as_yaml in (False, True):
            body = {**config("stops", run_model, corpus), "sampling": {"stop": stop}}
            one_line_400(submit(url, body, as_yaml=as_yaml), key)
    assert not (runs_root / "stops").exists()


def test_pagefleet_run_refuses_mistyped_values_in_files_and_overrides(tmp_path, capsys):
    """The same strictness without the service: one line naming the file and key, exit 2, before any work."""
    cases = [("sampling: {stop: [[1, 2]]}\n", [], "sampling.stop[0]"),
             ("sampling: {stop: [3]}\n", [], "sampling.stop[0]"),
             ("corpus: {path: [a.jsonl, b.jsonl]}\n", [], "corpus.path"),
             ("sampling: {seed: true}\n", [], "sampling.seed"),
             ("name: x\n", ["--sampling.stop=[1]"], "sampling.stop[0]"),
             ("name: x\n", ["--model.tokenizer=1.50"], "model.tokenizer"),
             ("name: x\n", ["--sampling.temperature=nan"], "sampling.temperature")]
    for text, overrides, key in cases:
        config_file = tmp_path / "run.yaml"
        config_file.write_text(text)
        capsys.readouterr()
        assert main(["run", str(config_file), f"--run_dir={tmp_path / 'run'}", *overrides]) == FAULT, (text, overrides)
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err, (text, overrides, err)
        assert (str(config_file) in err) if not overrides else (overrides[0] in err), err
        assert not (tmp_path / "run").exists()


def test_allow_url_takes_a_scheme_and_a_bucket():
    from orchestrator.service.service_paths import allowed_url

    assert allowed_url("gs://my-bucket") == ("gs", "my-bucket") and allowed_url("S3://b/") == ("s3", "b")
    for bad in ("gs://", "my-bucket", "gs://b/some/prefix", "file:///data", "memory://x", "simplecache::gs://b"):
        with pytest.raises(ValueError, match="--allow-url"):
            allowed_url(bad)
