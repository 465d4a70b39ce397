"""Placing a slice's hosts on TPU pod slices: the node label that names a host's pod slice, and the environment
that makes one host of a pod slice run alone on its own chips (host-level data parallelism)."""

from __future__ import annotations


SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
"""The node label Ray gives every host of a TPU pod slice (the slice's name)."""


def slice_name() -> str | None:
    """The pod slice name of the node this runs on (a Ray task in host 0's placement group)."""
    import ray

    return ray.get_runtime_context().get_node_labels().get(SLICE_NAME_LABEL)


TPU_CHIPS_PER_HOST_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
"""A host's chip grid by its chip count (as Ray lays out sub-slices: ray-project/ray#66029, util/tpu.py)."""


def single_host_tpu_env(chips: int) -> dict[str, str]:
    """Environment that makes a TPU host of a multi-host pod slice run alone on its own chips.

    By default libtpu on a pod-slice host forms the whole slice and waits for every host to join. Host bounds
    of 1,1,1 with this host's chip grid make it a slice of one host (pytorch/xla#7714: `TPU_HOST_BOUNDS=1,1,1`
    runs one host of a pod; jax-ml/jax#14977 and Ray's accelerators/tpu.py set the same variables, with
    TPU_VISIBLE_CHIPS, for sub-host allocations). The `PROCESS` names are newer libtpu's for the same bounds
    (set on v4 pod hosts next to the `HOST` ones). Ray leaves a task that holds all of a node's chips to the
    pod defaults and would drop TPU_VISIBLE_CHIPS, so RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS keeps ours.
    Checked on CPU only (no TPU here): see infra/README.md.
    """
    grid = TPU_CHIPS_PER_HOST_BOUNDS.get(chips, f"{chips},1,1")
    return {"TPU_HOST_BOUNDS": "1,1,1", "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_HOST_BOUNDS": grid,
            "TPU_CHIPS_PER_PROCESS_BOUNDS": grid, "TPU_VISIBLE_CHIPS": ",".join(str(c) for c in range(chips)),
            "RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS": "1"}
