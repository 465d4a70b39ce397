"""Planning throughput: plan a synthetic corpus on this machine and compare with the tokenizer alone.

    JAX_PLATFORMS=cpu RAY_AUTH_MODE=disabled python benchmarks/plan_bench.py --num-prompts 1000000 --num-cpus 2

Prints prompts/s of `plan` (Ray already started; reading, tokenizing, packing and writing the run
directory), the tokenizer's own batch-encode throughput on the same texts in a separate process
(`tokenizer._tokenizer.encode_batch_fast`, the call the planner makes, its Rust thread pool using every core;
corpus parsing not timed), their ratio
(goal >= 0.7), the head process's peak RSS from Ray's start on (goal <= 1.5 GiB at 10M prompts; writing the
corpus, when the benchmark writes one, is not counted) and the run directory's size. --repeats N plans N times and
reports medians, the plan and the tokenizer alternated. --median-words 1500 plans prompts of ~2k tokens instead;
--set KEY=VALUE passes a config override (e.g. corpus.window_rows).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("the of and to in is was for on that with as by at from his her an which it are be this or had not but what all "
         "were when we there can more if no out so said about up them some could him into its then two time like other "
         "ocean river mountain engine compiler theorem garden library window planet winter summer signal lantern harbor "
         "explain describe summarize translate write poem story proof function number question answer reason").split()


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (4k vocab) with a chat template, and a config.json; no weights needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    import numpy as np

    rng = np.random.default_rng(1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((" ".join(rng.choice(WORDS, 30)) for _ in range(2000)), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fast.save_pretrained(str(path))
    # vocab_size as a real model's config has it: planning then checks every prompt's ids against it, as it does
    # for users
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192,
                                                  "vocab_size": len(fast)}))


def write_corpus(path: Path, num_prompts: int, seed: int = 0, median_words: float | None = None) -> None:
    """JSON lines with log-normal word counts (median `median_words`, e**3.7 ~ 40 by default, long tail), one chat row
    in ten."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    mu, most = (3.7, 1500) if median_words is None else (np.log(median_words), 7000)  # ~7k tokens fit the 8k context
    with open(path, "w") as f:
        for start in range(0, num_prompts, 10_000):
            count = min(10_000, num_prompts - start)
            lengths = np.clip(rng.lognormal(mu, 0.8, count).astype(int), 1, most)
            pool = words[rng.integers(0, len(words), int(lengths.sum()))]
            cuts = np.concatenate([[0], np.cumsum(lengths)])
            lines = []
            for i in range(count):
                text = " ".join(pool[cuts[i]:cuts[i + 1]])
                row = start + i
                if row % 10 == 9:
                    lines.append(json.dumps({"id": f"r{row}", "messages": [{"role": "user", "content": text}]}))
                else:
                    lines.append(json.dumps({"id": f"r{row}", "prompt": text}))
            f.write("\n".join(lines) + "\n")


def baseline(model: str, corpus: str, limit: int | None = None) -> dict:
    """The tokenizer alone: batch-encode the same texts (chats rendered first, not timed); the first `limit` rows
    only, when given (a corpus of long prompts does not fit in memory as Python strings)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts, chats = [], []
    with open(corpus) as f:
        for line in itertools.islice(f, limit):
            row = json.loads(line)
            if "prompt" in row:
                texts.append(row["prompt"])
            else:
                chats.append(tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True))
    start = time.perf_counter()
    for group, special in ((texts, True), (chats, False)):
        for i in range(0, len(group), 10_000):  # the Rust backend directly: the fastest way to encode
            tok._tokenizer.encode_batch_fast(group[i:i + 10_000], add_special_tokens=special)
    elapsed = time.perf_counter() - start
    return {"prompts": len(texts) + len(chats), "seconds": elapsed, "prompts_per_s": (len(texts) + len(chats)) / elapsed}


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (Linux), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Start the process's peak RSS (VmHWM) afresh from its RSS now (Linux's clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def watch_anon_rss() -> list[int]:
    """[the process's peak RssAnon in bytes], kept up to date by a thread sampling /proc/self/status (Linux)."""
    import threading

    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], status_bytes("RssAnon"))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=1_000_000)
    parser.add_argument("--num-cpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--median-words", type=float, default=None,
                        help="median prompt length in words (~1 token each); 1500 gives prompts of ~2k tokens on average")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the plan, e.g. --set corpus.window_rows=100000")
    parser.add_argument("--workdir", default=None, help="where the corpus, tokenizer and run directories go (kept)")
    parser.add_argument("--baseline-prompts", type=int, default=None,
                        help="time the tokenizer alone on the corpus's first N prompts (its rate stands for all)")
    parser.add_argument("--baseline", nargs=2, metavar=("MODEL", "CORPUS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        print(json.dumps(baseline(*args.baseline, args.baseline_prompts)))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.median_words is None else f"-w{args.median_words:g}"
    model, corpus = work / "model", work / f"corpus-{args.num_prompts}{suffix}.jsonl"
    if not (model / "tokenizer.json").exists():
        model.mkdir(exist_ok=True)
        write_tokenizer(model)
    if not corpus.exists():
        t = time.perf_counter()
        write_corpus(corpus, args.num_prompts, median_words=args.median_words)
        print(f"wrote {corpus} ({corpus.stat().st_size / 2**20:,.0f} MiB) in {time.perf_counter() - t:.0f} s", flush=True)

    reset_peak_rss()  # writing the corpus (above) is not the plan's
    import logging

    import ray

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("orchestrator.plan.planner").setLevel(logging.INFO)  # phase timings
    from orchestrator.config import load_run_config
    from orchestrator.plan.planner import plan

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    peak_anon = watch_anon_rss()
    times, bases = [], []
    # The run directories are removed at the end, not between plans: right after many files are deleted, creating
    # files can be slow for a while (measured on an ext4 volume with online discard: 0.5 ms against 26 us a file
    # just after 30,000 were deleted), which the next plan's batch files would measure.
    for old in work.glob("run-*"):
        shutil.rmtree(old, ignore_errors=True)
    for i in range(args.repeats):  # plan and tokenizer alternated: the machine's drift reaches both alike
        run_dir = work / f"run-{i}"
        cfg = load_run_config(None, [f"--model.path={model}", f"--corpus.path={corpus}", f"--run_dir={run_dir}",
                                     "--sampling.max_new_tokens=256", "--engine.max_pages=4096", "--engine.max_seqs=64",
                                     "--engine.max_seqs_in_prefill=16", "--engine.max_prefill_size=1024",
                                     *[f"--{kv}" for kv in args.set]])
        start = time.perf_counter()
        result = plan(cfg)
        times.append(time.perf_counter() - start)
        run_dir_bytes = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
        sample = [] if args.baseline_prompts is None else ["--baseline-prompts", str(args.baseline_prompts)]
        bases.append(json.loads(subprocess.run([sys.executable, __file__, "--baseline", str(model), str(corpus), *sample],
                                               check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
        print(f"plan {i}: {times[-1]:.1f} s; tokenizer alone: {bases[-1]['seconds']:.1f} s", flush=True)
    ray.shutdown()
    peak_rss = status_bytes("VmHWM")
    for i in range(args.repeats):
        shutil.rmtree(work / f"run-{i}", ignore_errors=True)
    base = {"seconds": statistics.median(b["seconds"] for b in bases)}
    base["prompts_per_s"] = bases[0]["prompts"] / base["seconds"]  # of the rows it read (all, or the first N)
    plan_s = statistics.median(times)
    rate = result.stats.rows_read / plan_s
    print(result.stats.format())
    print(f"prompts:                   {result.stats.rows_read:,}")
    print(f"plan time (median of {len(times)}):  {plan_s:.1f} s (Ray already started)")
    print(f"plan throughput:           {rate:,.0f} prompts/s")
    print(f"tokenizer batch-encode:    {base['prompts_per_s']:,.0f} prompts/s ({base['seconds']:.1f} s, median of {len(bases)})")
    print(f"ratio plan / tokenizer:    {rate / base['prompts_per_s']:.2f} (goal >= 0.7)")
    print(f"run directory:             {run_dir_bytes / 2**30:.2f} GiB (corpus {corpus.stat().st_size / 2**30:.2f} GiB; the batch "
          "files hold each prompt's token ids and its passthrough columns, its text among them)")
    print(f"head peak RSS:             {peak_rss / 2**30:.2f} GiB (goal <= 1.5 GiB at 10M prompts)")
    print(f"  of which its own memory: {peak_anon[0] / 2**30:.2f} GiB at most (RssAnon, sampled every 0.2 s; the rest is "
          "the libraries and files mapped in, and any shared memory it touched)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
