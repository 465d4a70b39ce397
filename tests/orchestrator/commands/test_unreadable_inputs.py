"""Inputs the user may not read (the corpus, its directories, the model's files, `generate --input`): refused by the
kernel for real, in a process that has not the privilege to read them anyway (root without CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH, through util-linux's setpriv; any other user as it is)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.presets import write_model

from ..conftest import write_run_corpus

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "configs" / "demo.yaml"
UNPRIVILEGED = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search",
                "--inh-caps", "-dac_override,-dac_read_search"]


def cli(*args: str) -> subprocess.CompletedProcess:
    """`pagefleet ARGS` as this user without the privilege to read what file modes refuse."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, refusing a read needs util-linux's setpriv")
        prefix = UNPRIVILEGED
    return subprocess.run([*prefix, sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


def refused(proc: subprocess.CompletedProcess, command: str, key: str, path: Path, workers: bool = True) -> None:
    """The command stopped (exit 2) on one line naming the setting, the file and the fix: read access, not write."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stderr[-2000:]
    readers = "this user and by the Ray workers' user" if workers else "this user"
    assert err.splitlines() == [f"pagefleet {command}: {key}: cannot read {path} (Permission denied); make it "
                                f"readable by {readers}"], err
    assert "writable" not in err


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return Path(write_model("tiny-llama", tmp_path_factory.mktemp("model")))


def test_a_corpus_directory_the_user_may_not_read_stops_the_plan_rather_than_leaving_its_files_out(model, tmp_path):
    """fsspec's walk left an unreadable directory out, its files with it: the plan ran on the rest without a word.
    Then the planned run directory, unreadable to `status` and `export`, which only read it."""
    corpus = tmp_path / "corpus"
    for name in ("a", "b"):
        (corpus / name).mkdir(parents=True)
    write_run_corpus(corpus / "a" / "x.jsonl", 3)
    write_run_corpus(corpus / "b" / "y.jsonl", 3)
    (corpus / "b").chmod(0)
    try:
        for path in (corpus, corpus / "*" / "*.jsonl", corpus / "**"):
            proc = cli("plan", str(DEMO), f"--model.path={model}", f"--corpus.path={path}",
                       f"--run_dir={tmp_path / 'run'}")
            refused(proc, "plan", "corpus.path", corpus / "b")
            assert not (tmp_path / "run" / "batches.jsonl").exists()
        # A glob that does not reach the directory plans what it names.
        proc = cli("plan", str(DEMO), f"--model.path={model}", f"--corpus.path={corpus / 'a' / '*.jsonl'}",
                   f"--run_dir={tmp_path / 'run'}")
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        (corpus / "b").chmod(0o755)
    # status and export only read a run directory: a refusal there is not the writable location the others need.
    manifest = tmp_path / "run" / "batches.jsonl"
    manifest.chmod(0)
    try:
        refused(cli("status", str(tmp_path / "run")), "status", "RUN_DIR", manifest, workers=False)
        refused(cli("export", str(tmp_path / "run"), "--output", str(tmp_path / "out.jsonl"), "--partial"), "export",
                "RUN_DIR", manifest, workers=False)
    finally:
        manifest.chmod(0o644)
    # A volume's own lost+found (only root reads it) is not the corpus's: the plan goes on without it.
    (corpus / "lost+found").mkdir(mode=0)
    proc = cli("plan", str(DEMO), f"--model.path={model}", f"--corpus.path={corpus}", f"--run_dir={tmp_path / 'run2'}")
    assert proc.returncode == 0 and "rows read                   6" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_an_unreadable_corpus_file_or_model_file_names_read_access_as_the_fix(model, tmp_path):
    corpus = write_run_corpus(tmp_path / "c.jsonl", 3)
    for path, key in ((Path(corpus), "corpus.path"), (model / "tokenizer.json", "model.path")):
        path.chmod(0)
        try:
            proc = cli("plan", str(DEMO), f"--model.path={model}", f"--corpus.path={corpus}",
                       f"--run_dir={tmp_path / 'run'}")
        finally:
            path.chmod(0o644)
        refused(proc, "plan", key, path)


def test_unreadable_weights_stop_run_and_generate_before_they_start_and_generate_names_its_input(model, tmp_path):
    corpus = write_run_corpus(tmp_path / "c.jsonl", 3)
    weights = model / "model.safetensors"
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    generate = ["generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                "--output", str(tmp_path / "out.jsonl"), "--progress=false"]
    weights.chmod(0)
    try:
        refused(cli("run", str(DEMO), f"--model.path={model}", f"--corpus.path={corpus}",
                    f"--run_dir={tmp_path / 'run'}", "--tracker.type=noop"), "run", "model.path", weights)
        assert not (tmp_path / "run" / "batches.jsonl").exists()  # stopped before planning
        refused(cli(*generate), "generate", "--model", weights, workers=False)
    finally:
        weights.chmod(0o644)
    (tmp_path / "in.jsonl").chmod(0)
    try:
        refused(cli(*generate), "generate", "--input", tmp_path / "in.jsonl", workers=False)
    finally:
        (tmp_path / "in.jsonl").chmod(0o644)
    assert not (tmp_path / "out.jsonl").exists()


def test_a_refusal_outside_the_input_is_left_to_say_what_it_says(tmp_path):
    """`reading(only_under=True)` wraps building an engine, which also writes caches: a refused write there is not the
    model's, and keeps the command line's own advice (make the location writable)."""
    from orchestrator.storage.readable import Unreadable, reading

    elsewhere = PermissionError(13, "Permission denied", str(tmp_path / "cache" / "x"))
    model = str(tmp_path / "m")
    with pytest.raises(PermissionError) as raised, reading("--model", model, workers_read=False, only_under=True):
        raise elsewhere
    assert raised.value is elsewhere
    with pytest.raises(Unreadable, match="--model: cannot read .*/m/w.safetensors"):
        with reading("--model", model, workers_read=False, only_under=True):
            raise PermissionError(13, "Permission denied", str(tmp_path / "m" / "w.safetensors"))


@pytest.fixture
def denying_bucket():
    """A Cloud Storage endpoint on loopback that refuses every request as Cloud Storage refuses a caller without the
    permission (HTTP 403 and its JSON error); its `STORAGE_EMULATOR_HOST`."""
    import http.server
    import json
    import threading

    class Deny(http.server.BaseHTTPRequestHandler):
        def deny(self):
            body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.list access "
                                         "to the Google Cloud Storage bucket.", "errors": [{"reason": "forbidden"}]}})
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = do_PUT = do_HEAD = deny

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Deny)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_bucket_that_refuses_the_corpus_or_the_run_directory_is_one_line(model, tmp_path, denying_bucket):
    """gcsfs raises "Forbidden: PATH" with the store's message on a second line: two lines, no setting named."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "STORAGE_EMULATOR_HOST": denying_bucket}
    plan = [sys.executable, "-m", "orchestrator", "plan", str(DEMO), f"--model.path={model}"]
    corpus = write_run_corpus(tmp_path / "c.jsonl", 3)
    for args, expected in (
            (["--corpus.path=gs://bkt/c.jsonl", f"--run_dir={tmp_path / 'run'}"],
             "pagefleet plan: corpus.path: cannot read gs://bkt/c.jsonl (Forbidden: caller does not have "
             "storage.objects.list access to the Google Cloud Storage bucket.); give this user's credentials and the "
             "Ray workers' read access to it (storage.objects.get and storage.objects.list)"),
            ([f"--corpus.path={corpus}", "--run_dir=gs://bkt/run"],
             "pagefleet plan: Forbidden: b/bkt/o caller does not have storage.objects.list access to the Google Cloud "
             "Storage bucket.")):
        proc = subprocess.run(plan + args, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [expected], proc.stderr[-2000:]
