"""lm-evaluation-harness through pagefleet (`pagefleet.evaluation.PagefleetLM`) against lm-eval's own `hf` backend on
one tiny checkpoint: a multiple-choice task and a generation task over local JSON lines, and rolling
log-likelihoods. Nothing is downloaded."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval import simple_evaluate  # a dev dependency: a missing install fails here, it is not skipped
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from engine.models.presets import write_model  # noqa: E402
from engine.sizing.machine_sizing import STEP_TOKENS  # noqa: E402
from pagefleet.evaluation import PagefleetLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ENGINE = {"max_seq_len": 256, "max_pages": 256, "max_seqs": 16, "page_size": 8}
WORDS = "red blue green sea sky sun moon tree stone river".split()


def _tasks(root, n_questions: int = 12):
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    with mc.open("w") as f:
        for i in range(n_questions):
            choices = [" ".join(WORDS[(i + k + j) % len(WORDS)] for j in range(1 + k % 3)) for k in range(4)]
            f.write(json.dumps({"question": f"Question {i}: which {WORDS[i % len(WORDS)]} thing is best?",
                                "choices": choices, "answer": i % 4}) + "\n")
    with gen.open("w") as f:
        for i in range(6):
            f.write(json.dumps({"question": f"Say {WORDS[i]} {WORDS[i + 1]}:", "answer": WORDS[i]}) + "\n")
    (root / "pf_mc.yaml").write_text(f"""task: pf_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
num_fewshot: 0
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (root / "pf_gen.yaml").write_text(f"""task: pf_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return TaskManager(include_path=str(root))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model("tiny-llama", tmp_path_factory.mktemp("m")))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _evaluate(model, tasks: TaskManager) -> dict:
    return simple_evaluate(model=model, tasks=["pf_mc", "pf_gen"], task_manager=tasks, log_samples=True,
                           batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0, bootstrap_iters=0)


def test_tasks_through_pagefleet_equal_the_hf_backend(tmp_path, model_dir):
    tasks = _tasks(tmp_path)
    ours = _evaluate(PagefleetLM(model_dir, engine=ENGINE), tasks)
    hf = get_model("hf")(pretrained=model_dir, dtype="float32", device="cpu", batch_size=1)
    theirs = _evaluate(hf, tasks)
    for task in ("pf_mc", "pf_gen"):
        a, b = ours["samples"][task], theirs["samples"][task]
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            assert x["doc_id"] == y["doc_id"]
            if task == "pf_mc":
                for (lp_a, greedy_a), (lp_b, greedy_b) in zip(*(
                        [r[0] for r in s["resps"]] for s in (x, y))):
                    assert abs(lp_a - lp_b) < 1e-4 and greedy_a == greedy_b
            else:
                assert x["resps"] == y["resps"]
    for task, metrics in theirs["results"].items():
        for key, value in metrics.items():
            if key != "alias" and not key.endswith("_stderr,none"):
                assert ours["results"][task][key] == value, (task, key)


def test_rolling_loglikelihood_equals_the_hf_backend(model_dir):
    """Documents of one to a few windows (a short max_length). The hf backend sums each window in float32, so its
    totals carry up to half a float32 ulp per window: documents are kept short enough (totals of a few hundred,
    ulp 3e-5) that 1e-4 still measures the scores, not the reference's rounding."""
    docs = [" ".join((WORDS[i:] + WORDS[:i])[:2 + 2 * i]) for i in range(4)]
    requests = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    ours = PagefleetLM(model_dir, engine=ENGINE, max_length=8).loglikelihood_rolling(requests)
    hf = get_model("hf")(pretrained=model_dir, dtype="float32", device="cpu", batch_size=1, max_length=8)
    theirs = hf.loglikelihood_rolling(requests)
    assert all(math.isfinite(x) for x in ours)
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_pagefleet_is_an_lm_eval_model_name(model_dir):
    """As lm-eval's command line builds it from `--model pagefleet --model_args ...` (flat engine keys)."""
    assert get_model("pagefleet") is PagefleetLM
    lm = PagefleetLM.create_from_arg_string(f"model={model_dir},max_seqs=16,max_seq_len=64,max_pages=64",
                                            {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert lm.engine.config.max_seqs == 16 and lm.max_length == 63


def test_the_capacities_not_given_are_sized_for_the_machine(model_dir):
    """As `pagefleet generate` sizes them: prompts per step follow max_seqs (not the run path's default of 8, which
    left a multiple-choice task's steps a third full), the step is the platform's token budget; given keys stay."""
    config = PagefleetLM(model_dir, engine={"max_seqs": 16, "max_seq_len": 64, "max_pages": 64}).engine.config
    assert (config.max_seqs, config.max_seq_len, config.max_pages) == (16, 64, 64)
    assert config.max_seqs_in_prefill == 16 and config.max_prefill_size == STEP_TOKENS["cpu"]
    with pytest.raises(ValueError, match="unknown engine key"):
        PagefleetLM(model_dir, engine={"max_seq": 64})


@pytest.mark.slow  # a second process loads lm-eval, the model and compiles the engine's programs again
def test_the_lm_eval_command_line_runs_pagefleet(tmp_path, model_dir):
    """`python -m pagefleet.evaluation` is lm-eval's command line with `--model pagefleet` registered."""
    _tasks(tmp_path, n_questions=4)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    done = subprocess.run([sys.executable, "-m", "pagefleet.evaluation", "run", "--model", "pagefleet", "--model_args",
                           f"model={model_dir},max_seqs=8,max_seq_len=128,max_pages=64", "--tasks", "pf_mc",
                           "--include_path", str(tmp_path), "--output_path", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [results] = list(out.rglob("results_*.json"))
    assert "acc,none" in json.loads(results.read_text())["results"]["pf_mc"]
