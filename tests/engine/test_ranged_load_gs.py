"""Loading a checkpoint straight from a bucket (the Cloud Storage emulator) by ranged reads: each device reads
exactly the bytes of its shard, and the parameters equal those loaded from the local copy."""

import json
import os
import struct

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from engine import files, ranged_file
from engine.models.presets import write_model
from engine.models.weights import SafetensorsCheckpoint, _build, load_transformer, sharding
from engine.models.model_config import ModelConfig
from tests.gcs_emulator import assert_loaded_alike, upload


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama")))


def covered(view: np.ndarray, base: np.ndarray) -> set[int]:
    """Every byte offset of `base` that `view` holds, element by element (the slow, obvious way)."""
    lo = base.__array_interface__["data"][0]
    start = view.__array_interface__["data"][0] - lo
    out = set()
    for index in np.ndindex(view.shape):
        offset = start + sum(i * s for i, s in zip(index, view.strides))
        out.update(range(offset, offset + view.itemsize))
    return out


@pytest.mark.parametrize("make", [
    lambda w: w,
    lambda w: w.T,
    lambda w: w.T.reshape(6, 2, 5)[:, 1:2],
    lambda w: w[3:7],
    lambda w: w.T[:, 4:9],
    lambda w: w.T.reshape(6, 5, 2)[2:4, :, 1],
    lambda w: w[::-1, 2:3],
    lambda w: w[5:5],
])
def test_byte_ranges_are_exactly_the_bytes_a_view_holds(make):
    base = np.zeros(4 + 10 * 6 * 4, dtype=np.uint8)
    tensor = base[4:].view(np.float32).reshape(10, 6)
    view = make(tensor)
    ranges = ranged_file.byte_ranges(view, base)
    got = set()
    for s, e in ranges:
        got.update(range(s, e))
    if view.strides and min(view.strides) < 0:  # a reversed axis: the span it covers
        assert got >= covered(view, base)
    else:
        assert got == covered(view, base)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(ranges, ranges[1:]))  # sorted, disjoint, not adjacent
    with pytest.raises(ValueError, match="view of the checkpoint's buffer, not a copy"):
        ranged_file.byte_ranges(np.ascontiguousarray(tensor.T) + 1, base)


def test_every_device_reads_exactly_its_shard_and_gets_the_local_values(gcs_bucket, tiny):
    """As if each of 2 devices were on a host of its own: a fresh checkpoint per device, reading with no merging of
    ranges, fetches exactly the bytes of that device's shard of every parameter, and they equal the local ones."""
    url = upload(tiny, f"{gcs_bucket}/models/tiny")
    cfg = ModelConfig.from_pretrained(url)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    local = SafetensorsCheckpoint(tiny)
    checked = {"sharded": 0, "whole": 0}

    def check(names: list[str], axes, to_named, stacked: bool) -> None:
        shape = tuple(a.size for a in axes)
        for device, index in sharding(axes, mesh).addressable_devices_indices_map(shape).items():
            host = SafetensorsCheckpoint(url, merge_gap=0)
            selected = [names[i] for i in range(len(names))[index[0]]] if stacked else names
            inner = index[1:] if stacked else index
            parts = []
            for name in selected:
                part = host.read(name, lambda w: to_named(w)[inner])
                np.testing.assert_array_equal(part, to_named(local.get(name))[inner])
                parts.append(part)
            assert host.bytes_read == sum(p.nbytes for p in parts), (names[0], device)
            whole = sum(local.get(n).nbytes for n in selected)
            checked["sharded" if host.bytes_read < whole else "whole"] += 1

    def one(name, axes, to_named):
        return check([name], axes, to_named, stacked=False)

    def stacked(suffix, axes, to_named):
        return check([f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)], axes, to_named, stacked=True)

    _build(cfg, one, stacked, 1)  # tensor parallel within the KV heads: every tensor in the checkpoint's layout
    assert checked["sharded"] > 0 and checked["whole"] > 0  # split parameters read a part, replicated ones whole


def test_a_sharded_load_from_the_bucket_equals_the_local_load_and_reads_each_byte_once(gcs_bucket, tiny):
    url = upload(tiny, f"{gcs_bucket}/models/tiny")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    report: dict = {}
    remote = load_transformer(url, mesh=mesh, report=report)
    local = load_transformer(tiny, mesh=mesh)
    assert_loaded_alike(remote, local)
    # Both devices are this process's, so it needs every tensor: each byte of tensor data is read once.
    with open(os.path.join(tiny, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items() if k != "__metadata__")
    assert report["bytes_read"] == data and report["load_s"] > 0


def test_a_failed_range_request_is_retried(gcs_bucket, tiny, monkeypatch):
    url = upload(os.path.join(tiny, "config.json"), f"{gcs_bucket}/c.json")
    real, calls = files.filesystem, []

    class Flaky:
        def __init__(self, fs):
            self.fs = fs

        def cat_file(self, path, start=None, end=None):
            calls.append((start, end))
            if len(calls) == 1:
                raise ConnectionError("connection reset by peer")
            return self.fs.cat_file(path, start=start, end=end)

    monkeypatch.setattr(files, "filesystem", lambda u: (Flaky(real(u)[0]), real(u)[1]))
    with open(os.path.join(tiny, "config.json"), "rb") as f:
        assert files.read_range(url, 2, 40) == f.read()[2:40]
    assert calls == [(2, 40), (2, 40)]
