"""`ray job submit` against a `ray start --head` cluster, with the commands of docs/cluster.md as written."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.export.export import collect
from orchestrator.state.manifest import read_manifest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "cluster.md"


def documented_commands() -> list[str]:
    """The lines of the bash block that docs/cluster.md marks as tested."""
    text = DOC.read_text()
    match = re.search(r"<!-- tested by tests/orchestrator/run/test_job_submit\.py[^>]*-->\s*```bash\n(.*?)```", text, re.S)
    assert match, f"{DOC} lost its tested block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def a_fresh_checkout(tmp_path: Path, model: str, num_prompts: int) -> Path:
    """What the commands expect in the working directory: the virtualenv, configs/demo.yaml (its corpus cut to
    `num_prompts` rows, to keep the test short) and models/tiny-llama."""
    import sys

    root = tmp_path / "checkout"
    (root / "configs" / "data").mkdir(parents=True)
    (root / ".venv").symlink_to(Path(sys.prefix))
    shutil.copy(ROOT / "configs" / "demo.yaml", root / "configs" / "demo.yaml")
    rows = (ROOT / "configs" / "data" / "demo_prompts.jsonl").read_text().splitlines(keepends=True)
    (root / "configs" / "data" / "demo_prompts.jsonl").write_text("".join(rows[:num_prompts]))
    (root / "models").mkdir()
    (root / "models" / "tiny-llama").symlink_to(model)
    return root


def test_ray_job_submit_as_documented_runs_to_completion(ray_head_env, run_model, tmp_path):
    env, start_options, dashboard = ray_head_env
    root = a_fresh_checkout(tmp_path, run_model, num_prompts=12)
    env = {**env, "PYTHONPATH": str(ROOT)}  # this checkout's code, in the cluster (and so in the job) too
    lines = []
    for line in documented_commands():
        if line.startswith("ray start --head"):
            line += " " + start_options  # its own ports and temp dir, beside the other Rays on this machine
        lines.append(line.replace("127.0.0.1:8265", f"127.0.0.1:{dashboard}"))
    script = "set -e\n" + "\n".join(lines) + "\n"
    done = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "succeeded" in out.lower(), out[-5000:]
    assert (Path(env["HOME"]) / ".ray" / "auth_token").exists()  # token authentication was on
    # The job joined that cluster (ignoring the demo's local_num_cpus, with a note) rather than starting its own.
    assert "Connecting to existing Ray cluster" in out, out[-5000:]
    assert "cluster.local_num_cpus=2 is ignored" in out, out[-5000:]
    run_dir = root / "manifests" / "demo"
    records = read_manifest(run_dir / "batches.jsonl")
    assert records and all(r.status == "done" for r in records)
    assert collect(run_dir).num_rows == sum(r.num_prompts for r in records) == 12
