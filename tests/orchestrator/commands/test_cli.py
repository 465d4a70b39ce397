from pathlib import Path

import pytest

from orchestrator.commands.cli import main

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"


def test_plan_errors_name_the_fix(tiny_model, tmp_path, capsys):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("name: x\ncorpus: {path: nowhere.jsonl}\n")
    assert main(["plan", str(yaml), "--corpus.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert main(["plan", str(yaml)]) == 2
    assert "--model.path" in capsys.readouterr().err
    assert main(["plan", str(yaml), f"--model.path={tiny_model}"]) == 2
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


def test_help_lists_commands_with_descriptions_and_version(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command, words in [("run", "resumes a stopped run"), ("export", "corpus order"), ("generate", "no Ray"),
                           ("status", "Progress"), ("size", "capacities")]:
        assert any(line.split()[:1] == [command] and words in line for line in out.splitlines()), command
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip().startswith("pagefleet ")


@pytest.mark.parametrize("command", ["run", "plan"])
def test_run_and_plan_help_list_every_key(command, capsys):
    from orchestrator.config import RunConfig
    from orchestrator.config_reference import keys

    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pagefleet {command} CONFIG.yaml")
    for k in keys(RunConfig):
        assert f"--{k.name} " in out, k.name
    assert main([command]) == 2 and f"pagefleet {command} --help" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model.path=/no/such/model"], "pagefleet run: model.path '/no/such/model' does not exist"),
    (["--sampling.max_new_tokens"], "pagefleet run: argument --sampling.max_new_tokens: expected one argument"),
    (["--cluster.mesh=1"], "cluster.mesh must be a mapping, got an integer (1)"),  # strict types (config_types) speak first
])
def test_a_failed_start_is_one_line_and_leaves_no_run_directory(tmp_path, capsys, args, message):
    run_dir = tmp_path / "runs" / "x"
    assert main(["run", str(DEMO), f"--run_dir={run_dir}", "--tracker.type=noop", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()


@pytest.mark.parametrize("errno_name", ["EACCES", "EROFS"])
def test_an_unwritable_location_names_the_file_and_the_fix(monkeypatch, capsys, errno_name):
    """A read-only run directory (or output) named the file but not what to do (root ignores modes, so the
    refusal is raised where the command writes)."""
    import errno
    import os

    from orchestrator.commands import cli

    def refuse(argv):
        code = getattr(errno, errno_name)
        raise PermissionError(code, os.strerror(code), "/runs/demo/batches.jsonl")

    monkeypatch.setattr(cli, "_command_main", lambda command: refuse)
    assert main(["status", "/runs/demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err]
    assert "/runs/demo/batches.jsonl" in err and "make it writable by this user, or give another location" in err


def test_the_head_plans_and_reads_a_run_without_importing_jax(run_model, tmp_path):
    """The head's commands never load JAX (only a slice's engine runs it): loading it cost every `pagefleet run` and
    `plan` ~1 s of start-up and ~140 MiB of the head's memory. A plan in the head's process (a small corpus), then
    `status` and `export`, in a fresh process whose modules are then listed."""
    import subprocess
    import sys

    from ..conftest import run_args, write_run_corpus

    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 12)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: head\n")
    code = ("import sys\n"
            "from orchestrator.commands.cli import main\n"
            "import orchestrator.commands.run\n"
            f"assert main(['plan', {str(config)!r}, *{run_args(run_model, corpus, run_dir)!r}]) == 0\n"
            f"assert main(['status', {str(run_dir)!r}]) == 0\n"
            # nothing is done yet: export refuses (exit 2) unless --partial, which writes no sample
            f"export = ['export', {str(run_dir)!r}, '--output', {str(tmp_path / 'out.jsonl')!r}]\n"
            "assert main(export) == 2\n"
            "assert main([*export, '--partial']) == 0\n"
            "print('heavy:', sorted(m for m in ('jax', 'jaxlib', 'haliax', 'equinox') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "heavy: []" in done.stdout, done.stdout[-2000:]
    assert "batches are not done" in done.stderr and "wrote 0 samples" in done.stdout, done.stderr[-2000:]
    assert (tmp_path / "out.jsonl").read_text() == ""
