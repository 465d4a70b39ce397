"""Multiple-choice evaluation speed: lm-evaluation-harness through pagefleet (`PagefleetLM`) against lm-eval's own
`hf` backend, on one task of `--questions` questions x 4 choices over local JSON lines (nothing downloaded).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/eval_bench.py --questions 1000

Both sides score the same requests on the same weights (`--preset`, seed 0), in float32 on the CPU; each question is a
few-shot-like prompt of `--context-words` words and 4 short choices. Timed: `simple_evaluate` end to end, model load
and (for pagefleet) compilation included, each side once; printed: both wall times, the ratio (acceptance: >= 3),
whether the accuracies are equal, and the largest per-request log-likelihood difference. `--hf-batch-size` is the hf
backend's batch size (lm-eval's default is 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from engine.models.presets import write_model  # noqa: E402
from pagefleet.evaluation import PagefleetLM  # noqa: E402

WORDS = ("red blue green sea sky sun moon tree stone river cloud rain wind fire snow leaf bird fish road hill "
         "house door light night day song word book ship star").split()


def write_task(root: Path, questions: int, context_words: int) -> TaskManager:
    rng = random.Random(0)
    data = root / "mc.jsonl"
    with data.open("w") as f:
        for i in range(questions):
            context = " ".join(rng.choice(WORDS) for _ in range(context_words))
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)]
            f.write(json.dumps({"question": f"{context}\nQuestion {i}: what comes next?", "choices": choices,
                                "answer": rng.randrange(4)}) + "\n")
    (root / "bench_mc.yaml").write_text(f"""task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
""")
    return TaskManager(include_path=str(root))


def timed(make_model, tasks: TaskManager) -> tuple[float, dict]:
    start = time.perf_counter()
    results = simple_evaluate(model=make_model(), tasks=["bench_mc"], task_manager=tasks, log_samples=True,
                              bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                              fewshot_random_seed=0)
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--context-words", type=int, default=120)
    parser.add_argument("--preset", default="llama-40m")
    parser.add_argument("--hf-batch-size", default="8")
    parser.add_argument("--max-seqs", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(write_model(args.preset, root / "model"))
        tasks = write_task(root, args.questions, args.context_words)
        engine = {"max_seqs": args.max_seqs, "max_seq_len": 1024, "max_pages": 4096, "max_prefill_size": 2048}
        ours_s, ours = timed(lambda: PagefleetLM(model, engine=engine), tasks)
        hf_s, theirs = timed(lambda: get_model("hf")(pretrained=model, dtype="float32", device="cpu",
                                                     batch_size=args.hf_batch_size), tasks)
    diff = max(abs(a[0][0] - b[0][0]) for x, y in zip(ours["samples"]["bench_mc"], theirs["samples"]["bench_mc"])
               for a, b in zip(x["resps"], y["resps"]))
    acc = ours["results"]["bench_mc"]["acc,none"], theirs["results"]["bench_mc"]["acc,none"]
    print(f"{args.questions} questions x 4 choices, {args.preset}, float32 CPU")
    print(f"pagefleet: {ours_s:.1f} s; hf backend (batch_size {args.hf_batch_size}): {hf_s:.1f} s; "
          f"ratio {hf_s / ours_s:.2f}x (acceptance >= 3)")
    print(f"accuracy pagefleet {acc[0]:.4f}, hf {acc[1]:.4f} ({'equal' if acc[0] == acc[1] else 'DIFFERENT'}); "
          f"largest log-likelihood difference {diff:.2e}")


if __name__ == "__main__":
    main()
