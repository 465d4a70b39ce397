"""A 2-host slice on one machine: two JAX processes (2 CPU devices each) run one Engine as one SPMD program.

Both hosts must produce the same completions, stats and snapshots, equal to a single-process,
single-device run of the same requests; hosts given different inputs must fail, on every host,
with an error naming what differs, and nothing may hang.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.models import presets
pytestmark = pytest.mark.multihost

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = WORKER.parents[2]
TIMEOUT_S = 120
LOGPROB_ATOL = 1e-4  # sharded contractions (o_proj, down_proj) sum partial products in another order


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """tiny-llama (2 KV heads: model axis up to 2) and a 4-KV-head variant for a model axis of 4."""
    root = tmp_path_factory.mktemp("models")
    kv4 = dataclasses.replace(presets.PRESETS["tiny-llama"], num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    presets.PRESETS["tiny-llama-kv4"] = kv4
    try:
        return {"tiny-llama": presets.write_model("tiny-llama", root / "tiny-llama"),
                "tiny-llama-kv4": presets.write_model("tiny-llama-kv4", root / "tiny-llama-kv4")}
    finally:
        del presets.PRESETS["tiny-llama-kv4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, args: list[str], num_processes: int, local_devices: int, tag: str) -> list[dict]:
    """Run the worker as `num_processes` processes of one slice; return each one's JSON result."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}"}
    coordinator = f"127.0.0.1:{free_port()}"
    procs, outs = [], []
    try:
        for i in range(num_processes):
            out = tmp_path / f"{tag}-{i}.json"
            log = open(tmp_path / f"{tag}-{i}.log", "w")
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), *args, "--coordinator", coordinator, "--num-processes",
                 str(num_processes), "--process-id", str(i), "--local-devices", str(local_devices), "--out", str(out)],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
            outs.append(out)
        start = time.monotonic()
        deadline = start + TIMEOUT_S
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{tag}: process {i} still running after {TIMEOUT_S} s (hung?); log:\n"
                            + (tmp_path / f"{tag}-{i}.log").read_text()[-3000:])
            assert rc == 0, f"{tag}: process {i} exited with {rc}; log:\n" + (tmp_path / f"{tag}-{i}.log").read_text()[-3000:]
        print(f"{tag}: {num_processes} processes took {time.monotonic() - start:.1f} s")
    finally:
        for p in procs:  # stragglers of a failed run: ours, by pid
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(o.read_text()) for o in outs]


def two_hosts_and_one_device(tmp_path, specs: list[str]) -> list[tuple[str, dict, dict]]:
    """Each `model:width` spec on one device and on a 2-host x 2-device slice: asserts that the hosts agree and
    give one device's tokens (logprobs within LOGPROB_ATOL); (spec, host 0's result, the device's) for more."""
    args = [a for s in specs for a in ("--model", s)]
    (reference,) = launch(tmp_path, args, num_processes=1, local_devices=1, tag="single")
    host0, host1 = launch(tmp_path, args, num_processes=2, local_devices=2, tag="slice")
    for spec in specs:
        a, b, ref = host0[spec], host1[spec], reference[spec]
        # Every host reads the same results and the same stats (no leader-only read).
        assert a == b, f"{spec}: the two hosts differ"
        assert a["token_ids"] == ref["token_ids"], f"{spec}: the slice differs from one device"
        for got, want in zip(a["logprobs"], ref["logprobs"]):
            np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    return [(spec, host0[spec], reference[spec]) for spec in specs]


def test_two_hosts_equal_each_other_and_one_device(tmp_path, models):
    specs = [f"{models['tiny-llama']}:2", f"{models['tiny-llama-kv4']}:4"]  # (data 2, model 2) and (data 1, model 4)
    for spec, a, ref in two_hosts_and_one_device(tmp_path, specs):
        assert a["stats"] == ref["stats"] and a["snapshot"] == ref["snapshot"]
        assert a["snapshot"]["pages_in_use"] == 0  # cleanup_mode incremental: everything freed at the end
        assert a["snapshot_after_reset"]["free_pages"] == 96
        assert all(len(t) > 0 for t in a["token_ids"])
        seeded = a["token_ids"][6:]
        assert any(seeded[i] != seeded[i + 1] for i in range(0, len(seeded), 2)), f"{spec}: samples of a prompt all equal"


@pytest.mark.slow  # ~75 s; the default run covers its parts: the experts spread over 4 devices in one process
# (tests/engine/models/test_moe.py) and a slice of two processes (the dense test above)
def test_a_mixture_of_experts_over_two_hosts_equals_one_device(tmp_path):
    """tiny-qwen3-moe (8 experts, top-3, a dense layer between sparse ones) at model 2 (data 2 x model 2) and model 4
    (across both hosts): each device holds 8 / model whole experts (expert parallelism, engine/models/moe.py) and its
    slice of the dense MLP, every device routes every row, and the tokens are one device's."""
    model = presets.write_model("tiny-qwen3-moe", tmp_path / "tiny-qwen3-moe")
    for spec, a, ref in two_hosts_and_one_device(tmp_path, [f"{model}:2", f"{model}:4"]):
        assert a["stats"] == ref["stats"], f"{spec}: the slice's steps differ from one device's"
        assert all(len(t) > 0 for t in a["token_ids"])


@pytest.mark.slow
def test_one_kv_head_over_two_hosts_equals_one_device(tmp_path):
    """tiny-mistral has one KV head: at model 2 (data 2 x model 2) and model 4 (across both hosts) each KV head is
    replicated on every device of its model group (engine/models/tensor_parallel.py), and the tokens are one device's."""
    model = presets.write_model("tiny-mistral", tmp_path / "tiny-mistral")
    assert len(two_hosts_and_one_device(tmp_path, [f"{model}:2", f"{model}:4"])) == 2


def test_hosts_that_disagree_fail_everywhere_naming_what_differs(tmp_path, models):
    host0, host1 = launch(tmp_path, ["--mode", "agree", "--model", f"{models['tiny-llama']}:1"],
                          num_processes=2, local_devices=2, tag="agree")
    for errors in (host0, host1):
        assert "'engine_config'" in errors["engine_config"]
        assert "processes [1]" in errors["engine_config"] and "'model_config'" not in errors["engine_config"]
        assert "'requests'" in errors["requests"] and errors["steps_run"] == 0
        assert "different sets of keys" in errors["keys"] and "process 1: 2 keys" in errors["keys"]
    # Mesh-less engines are per process: host 1's batch starts one request later than host 0's.
    assert host1["local_token_ids"][0] == host0["local_token_ids"][1]


@pytest.mark.slow  # two JAX processes loading from the Cloud Storage emulator: ~20 s
def test_each_host_reads_only_its_shards_from_the_bucket(tmp_path, models, gcs_bucket):
    from tests.gcs_emulator import upload

    local = models["tiny-llama"]
    url = upload(str(local), f"{gcs_bucket}/models/tiny")
    hosts = launch(tmp_path, ["--mode", "load", "--model", f"{url}:2", "--local", str(local)], num_processes=2,
                   local_devices=1, tag="load")
    with open(local / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert {m["dtype"] for k, m in header.items() if k != "__metadata__"} == {"F32"}  # shard bytes = file bytes
    data = sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items() if k != "__metadata__")
    for host in hosts:
        assert host["equal"], host
        assert host["bytes_read"] == host["shard_bytes"] < data, (host, data)  # its shards, nothing more


def test_swap_on_two_hosts_gives_the_samples_of_recompute_and_of_an_ample_pool(tmp_path, models):
    """A host pool on a 2-host slice (model 4 over both hosts: each host holds two of a page's four KV heads): a device
    pool too small for the workload under `swap` gives the tokens and logprobs, bit for bit, of `recompute` and of
    an ample pool; pages move both ways (swaps, and the prefix cache's host tier on the second call) and nothing is
    recomputed. Both hosts decide the same page moves, step by step, and each holds only its own shard."""
    host0, host1 = launch(tmp_path, ["--mode", "swap", "--model", f"{models['tiny-llama-kv4']}:4"],
                          num_processes=2, local_devices=2, tag="swap")
    assert host0 == host1, "the two hosts decided or sampled differently"
    ample, recompute, swap = host0["ample"], host0["recompute"], host0["swap"]
    assert swap["samples"] == recompute["samples"] == ample["samples"]
    assert ample["preemptions"] == 0 and recompute["preemptions"] > 0 and swap["preemptions"] > 0
    moved, dropped = swap["stats"], recompute["stats"]
    assert moved["kv_pages_out"] > 0 and moved["kv_pages_in"] > 0 and moved["recompute_avoided_tokens"] > 0
    assert moved["recompute_tokens"] == 0 and swap["fallbacks"] == 0 and dropped["recompute_tokens"] > 0
    assert 0 < moved["host_kv_pages_peak"] <= 64 and moved["kv_pages_in_ahead"] > 0  # some a step ahead
    assert swap["host_share"] == 0.5  # each host copies its own half of every page, nothing more
    assert any(ins[0] or ahead[0] for _, ins, ahead in swap["moves"]) and any(out[0] for out, _, _ in swap["moves"])
    assert swap["host_tier_pages_in"] > 0  # the prefix cache's host tier served the second call's shared prefix
