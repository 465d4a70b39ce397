from orchestrator.slices.cluster import ClusterConfig
from orchestrator.slices.waiting import SLOW_START_S, slice_demand, slices_that_fit, waiting_text


def test_slices_beyond_the_cluster_are_reported_at_once():
    cluster = ClusterConfig(num_slices=4)
    text = waiting_text(2, 2, cluster, {"CPU": 2.0}, {"CPU": 0.0}, waited_s=0.0)
    assert text == ("2 of 4 slices wait for resources the cluster does not have (2 started): a slice needs CPU 1, "
                    "the cluster has CPU 2 in all; add nodes or lower --cluster.num_slices to 2")


def test_slices_that_fit_are_reported_only_when_slow():
    cluster = ClusterConfig(num_slices=2)
    assert waiting_text(2, 0, cluster, {"CPU": 2.0}, {"CPU": 0.0}, waited_s=1.0) is None  # loading, likely
    text = waiting_text(2, 0, cluster, {"CPU": 2.0}, {"CPU": 0.0}, waited_s=SLOW_START_S)
    assert text.startswith("2 of 2 slices not started after 60 s: a slice needs CPU 1, CPU 0 free now of CPU 2")
    assert waiting_text(0, 2, cluster, {"CPU": 2.0}, {"CPU": 0.0}, waited_s=100.0) is None


def test_a_multi_host_tpu_slice_needs_every_host_and_its_head_resource():
    cluster = ClusterConfig(hosts_per_slice=2, resources_per_host={"TPU": 4}, slice_head_resource="TPU-v5p-16-head")
    demand = slice_demand(cluster)
    assert demand == {"TPU": 8, "TPU-v5p-16-head": 1}
    assert slices_that_fit(demand, {"TPU": 16, "TPU-v5p-16-head": 1}) == 1
