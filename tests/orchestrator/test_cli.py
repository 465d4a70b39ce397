from pathlib import Path

import pytest

from orchestrator.cli import main

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_plan_errors_name_the_fix(tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("name: x\ncorpus: {path: nowhere.jsonl}\n")
    assert main(["plan", str(yaml), "--corpus.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["plan", str(yaml)]) == 2
    assert "--model.path" in capsys.readouterr().err
    assert main(["plan", str(yaml), f"--model.path={tmp_path}"]) == 2
    assert "corpus.path" in capsys.readouterr().err
    assert main(["plan"]) == 2


@pytest.mark.ray
def test_plan_command_prints_the_capacity_report(tiny_model, tmp_path, capsys, ray_local):
    (tmp_path / "c.jsonl").write_text('{"id": "a", "prompt": "hello world"}\n{"prompt": ""}\n')
    args = ["plan", str(DEMO), f"--model.path={tiny_model}", f"--corpus.path={tmp_path}/c.jsonl",
            f"--run_dir={tmp_path}/run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for text in ("rows read", "empty_prompt", "packing efficiency: 1 batches / lower bound 1 = 1.000", "prompt length"):
        assert text in out
    assert main(args) == 0 and "already planned" in capsys.readouterr().out
