"""batches.jsonl on an object store (the Cloud Storage emulator): every replacement is conditioned on the
generation its writer last saw, so a head that lost the run fails loudly instead of overwriting."""

import dataclasses

import pytest

from orchestrator.storage import location, storage
from orchestrator.state.manifest import (BatchRecord, ManifestConflict, read_manifest, read_manifest_generation,
                                   write_manifest)


def test_a_manifest_write_that_loses_the_generation_race_fails_and_overwrites_nothing(gcs_bucket):
    path = f"{gcs_bucket}/run/batches.jsonl"
    plan = [BatchRecord("b000000", num_prompts=3), BatchRecord("b000001", num_prompts=2)]
    g0 = write_manifest(path, plan)  # the planner: only if absent
    with pytest.raises(ManifestConflict, match="expected it absent"):
        write_manifest(path, plan)  # a second planner of the same run directory
    # Two heads both read generation g0 (the first stalled past its lock and was taken over).
    old_head, g_old = read_manifest_generation(path)
    new_head, g_new = read_manifest_generation(path)
    assert g_old == g_new == g0 and old_head == new_head == plan
    taken = [dataclasses.replace(plan[0], status="running", slice="slice-0"), plan[1]]
    g1 = write_manifest(path, taken, generation=g_new)
    assert g1 != g0
    stale = [dataclasses.replace(plan[0], status="done"), plan[1]]
    with pytest.raises(ManifestConflict, match=f"written by another head .* at generation {g0}.* stopping"):
        write_manifest(path, stale, generation=g_old)
    assert read_manifest(path) == taken  # the new head's write stands
    assert write_manifest(path, stale, generation=g1) != g1  # the owner's own next write goes through


def test_local_manifest_unchanged(tmp_path):
    plan = [BatchRecord("b000000", num_prompts=3)]
    assert write_manifest(tmp_path / "batches.jsonl", plan) is None
    assert read_manifest_generation(tmp_path / "batches.jsonl") == (plan, None)
    assert not storage.is_url(tmp_path / "batches.jsonl")


def test_a_head_whose_manifest_was_replaced_stops_instead_of_overwriting(gcs_bucket):
    """RunState (the head's manifest owner) conditions each flush on the generation it last read or wrote."""
    from orchestrator.state.lock import RunDirLocked
    from orchestrator.state.run_state import RunState
    from orchestrator.state.rundir import RunDir

    run_dir = RunDir(location.location(f"{gcs_bucket}/run"))
    write_manifest(run_dir.manifest, [BatchRecord("b000000", num_prompts=1), BatchRecord("b000001", num_prompts=1)])
    state = RunState.recover(run_dir, samples_per_prompt=1, plan="p")
    state.mark_running("b000000", "slice-0")
    state.flush(force=True)  # its own writes go through, each against the generation it wrote last
    _, generation = read_manifest_generation(run_dir.manifest)
    theirs = [BatchRecord("b000000", status="running", slice="other-head", num_prompts=1),
              BatchRecord("b000001", num_prompts=1)]
    write_manifest(run_dir.manifest, theirs, generation=generation)  # another head took the run over
    state.mark_running("b000001", "slice-1")
    with pytest.raises(RunDirLocked, match="written by another head"):
        state.flush(force=True)
    assert read_manifest(run_dir.manifest) == theirs
