"""infra/: the Ray cluster YAMLs parse, name the image, and provide what the run configs request."""

import math
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
# Each deployment config and the cluster it runs on.
PAIRS = [
    ("configs/llama3.1-8b-v5p-16.yaml", "infra/cluster-v5p-16.yaml"),
    ("configs/llama3.1-8b-v6e-8.yaml", "infra/cluster-v6e-8.yaml"),
]


def tpu_slice(accelerator_type: str) -> tuple[int, int]:
    """(chips per host, hosts) of a TPU accelerator type, by the rule Ray applies.

    v4 and v5p count TensorCores in the name (2 per chip) and have 4 chips per host; v5e
    (v5litepod) and v6e count chips and put up to 8 on a single-host slice.
    """
    generation, count = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type).groups()
    if generation in ("v4", "v5p"):
        chips, per_host = int(count) // 2, 4
    elif generation in ("v5litepod", "v6e"):
        chips = int(count)
        assert chips <= 8, "multi-host v5e/v6e slices: check Ray's chips per host before adding one"
        per_host = chips
    else:
        raise AssertionError(f"unknown TPU generation {generation}")
    return per_host, math.ceil(chips / per_host)


def tpu_node_types(cluster: dict) -> dict[str, dict]:
    return {name: t for name, t in cluster["available_node_types"].items() if "acceleratorType" in t["node_config"]}


@pytest.mark.parametrize("path", sorted(INFRA.glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_infra_yaml_parses(path):
    assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize("path", sorted(INFRA.glob("cluster-*.yaml")), ids=lambda p: p.name)
def test_cluster_names_the_image_and_tpu_resources(path):
    cluster = yaml.safe_load(path.read_text())
    assert re.fullmatch(r"\S+/pagefleet:\S+", cluster["docker"]["image"])
    assert "--privileged" in cluster["docker"]["run_options"]  # the TPU devices inside the container
    assert cluster["available_node_types"][cluster["head_node_type"]]["node_config"]["machineType"]
    types = tpu_node_types(cluster)
    assert types, "no TPU worker node type"
    for name, node in types.items():
        per_host, _ = tpu_slice(node["node_config"]["acceleratorType"])
        assert node["node_config"]["runtimeVersion"]
        assert node["resources"] == {"TPU": per_host}, name
        # The slice head resource must stay on worker 0: never declared for every host.
        assert not any(key.endswith("-head") for key in node["resources"]), name
        assert node["min_workers"] == node["max_workers"], "whole slices do not autoscale"


@pytest.mark.parametrize("config, cluster", PAIRS, ids=[c for c, _ in PAIRS])
def test_run_config_requests_what_the_cluster_provides(config, cluster):
    cfg = load_run_config(ROOT / config).cluster
    node, = tpu_node_types(yaml.safe_load((ROOT / cluster).read_text())).values()
    accelerator_type = node["node_config"]["acceleratorType"]
    per_host, hosts = tpu_slice(accelerator_type)
    assert cfg.resources_per_host == node["resources"] == {"TPU": per_host}
    assert cfg.slice_head_resource == f"TPU-{accelerator_type}-head"
    assert (cfg.hosts_per_slice, cfg.devices_per_host) == (hosts, per_host)
    assert cfg.num_slices == node["max_workers"]
    assert (per_host * hosts) % cfg.mesh["model"] == 0


def test_dockerfile_installs_pinned_pagefleet_tpu():
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r'pip install -c infra/constraints\.txt "\.\[tpu\]"', dockerfile)
    assert re.search(r"^FROM python:3\.11\.\d+-", dockerfile, re.M)
    pins = [line for line in (INFRA / "constraints.txt").read_text().splitlines() if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==\S+", line) for line in pins), pins
    names = {line.split("==")[0].lower() for line in pins}
    assert {"jax", "jaxlib", "haliax", "ray", "transformers"} <= names
