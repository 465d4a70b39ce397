"""A multi-host TPU slice's host actors all land on one pod slice.

Ray gives every host of a TPU pod slice the node label `ray.io/tpu-slice-name`, and worker 0 of each
slice a head resource (`TPU-v5p-16-head`). The head resource alone picks a slice for host 0; the other
hosts must then be placed on that same slice, never on another slice's free hosts. Real Ray, several
labelled nodes (ray.cluster_utils.Cluster), in a child process because the session's local Ray is
single-node.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ..conftest import run_args, write_run_corpus

pytestmark = [pytest.mark.ray]

CHILD = r'''
import json, os, sys
os.environ["RAY_AUTH_MODE"] = "disabled"
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.config import load_run_config
from orchestrator.slices.slice_gang import SliceGang
from orchestrator.slices.tpu_placement import SLICE_NAME_LABEL

args = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
# Cluster records its address for a plain ray.init() to join: where every Ray on the machine looks for it unless
# RAY_TMPDIR is private (a `pagefleet run` started meanwhile by another test would join this fake cluster)
shared = "/tmp/ray/ray_current_cluster"
out = {"recorded_in_shared_tmp": os.path.exists(shared) and open(shared).read().strip() == cluster.head_node.gcs_address}
def node(pod, head=None):
    return cluster.add_node(num_cpus=1, resources={"chips": 4, **({head: 1} if head else {})},
                            labels={SLICE_NAME_LABEL: pod} if pod else {})
a0, a1, b1, c0 = node("pod-a", "FAKE-TPU-head"), node("pod-a"), node("pod-b"), node(None, "UNLABELLED-head")
ray.init(address=cluster.address, log_to_driver=False)
labels = {n["NodeID"]: n.get("Labels", {}).get(SLICE_NAME_LABEL) for n in ray.nodes()}

@ray.remote(num_cpus=0, resources={"chips": 4})
class Blocker:
    def ready(self):
        return True

# pod-a's second host is busy; pod-b's is free.
blocker = Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(a1.node_id, soft=False)).remote()
ray.get(blocker.ready.remote())

def gang(head):
    cfg = load_run_config(None, args + ["--cluster.hosts_per_slice=2", f"--cluster.slice_head_resource={head}",
                                        "--cluster.resources_per_host={CPU: 0.5, chips: 4}",
                                        "--cluster.placement_strategy=STRICT_SPREAD"])
    g = SliceGang(0, cfg)
    g.spawn()
    ready, _ = ray.wait(g.refs(), timeout=120)  # the pod slice name of host 0's node
    return g, g.handle(ready[0])

g, event = gang("FAKE-TPU-head")
out["located"] = event.kind
out["host0"] = labels[ray.util.placement_group_table(g._head_group)["bundles_to_node_id"][0]]
out["placed_while_busy"] = bool(ray.wait([g.placement_group.ready()], timeout=5)[0])
ray.kill(blocker)
out["placed_when_free"] = bool(ray.wait([g.placement_group.ready()], timeout=120)[0])
out["other_hosts"] = [labels[n] for n in ray.util.placement_group_table(g.placement_group)["bundles_to_node_id"].values()]
g.kill()

g, event = gang("UNLABELLED-head")
out["unlabelled"] = [event.kind, event.reason]
g.kill()
print("RESULT " + json.dumps(out))
ray.shutdown()
cluster.shutdown()
'''


def test_hosts_of_a_slice_stay_on_host_0s_pod_slice(run_model, tmp_path):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = Path(__file__).resolve().parents[3]
    temp = tempfile.mkdtemp(prefix="pf-")  # short: Ray's unix socket paths must stay under 108 bytes
    try:
        proc = subprocess.run([sys.executable, str(script), json.dumps(run_args(run_model, corpus, tmp_path / "run"))],
                              cwd=root, env={**os.environ, "PYTHONPATH": str(root), "RAY_TMPDIR": temp},
                              capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0].removeprefix("RESULT "))
    assert not out["recorded_in_shared_tmp"]
    assert out["located"] == "waiting" and out["host0"] == "pod-a"
    assert not out["placed_while_busy"]  # waits for pod-a's own host rather than taking pod-b's free one
    assert out["placed_when_free"] and out["other_hosts"] == ["pod-a"]
    kind, reason = out["unlabelled"]
    assert kind == "failed" and "no ray.io/tpu-slice-name label" in reason and "cluster.slice_head_resource" in reason
