import json
import os

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tiny_model(path, max_position_embeddings: int = 256) -> str:
    """A byte-level BPE tokenizer with a chat template and a config.json: all that planning reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "write a poem about the sea", "hello world"] * 50
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(str(path))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "max_position_embeddings": max_position_embeddings}, f)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session (2 CPUs, no dashboard, no auth)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        # address="local": always a fresh cluster of our own, never a cluster some earlier `ray start` left recorded
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


RUN_WORDS = "the quick brown fox jumps over a lazy dog while sea poems hello world data model".split()


def write_run_corpus(path, num_prompts: int, seed: int = 0) -> str:
    """Text and chat rows of 3 to 25 words (about 10 to 100 tokens with the tiny tokenizer)."""
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_prompts):
            text = " ".join(rng.choice(RUN_WORDS) for _ in range(rng.randint(3, 25)))
            row = {"id": f"q{i}", "messages": [{"role": "user", "content": text}]} if i % 3 == 0 else \
                {"id": f"q{i}", "prompt": text}
            f.write(json.dumps(row) + "\n")
    return str(path)


def poison_batch(run_dir, batch_id: str = "b000001"):
    """Make a planned batch's first prompt end in a token id beyond the vocabulary, so its slice refuses the batch
    every time (a deterministic fault, failed at once). Returns the batch's original table, to repair it with."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = run_dir / "batches" / f"{batch_id}.parquet"
    good = pq.read_table(path)
    ids = good["token_ids"].to_pylist()
    ids[0] = ids[0][:-1] + [10**6]
    pq.write_table(good.set_column(2, "token_ids", pa.array(ids, good.schema.field("token_ids").type)), path)
    return good


@pytest.fixture(scope="session")
def run_model(tmp_path_factory) -> str:
    """The tiny-llama preset as `pagefleet init-model` writes it (real weights, tokenizer, chat template)."""
    from engine.models.presets import write_model

    return str(write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def run_in_own_process(run_model, tmp_path_factory) -> dict:
    """`pagefleet run` in a process of its own, as a user's shell starts it: umask 027, its own local Ray (no
    RAY_ADDRESS, RAY_TMPDIR or TMPDIR), stderr into a file as under `ray job submit`, PAGEFLEET_PROGRESS=1 with a
    line every 2 s, and four slices on a two-CPU Ray, so that two wait. One such process costs ~20 s on 2 cores, so
    one run serves every test of what the process shows: its progress lines (observe/test_progress.py), its files'
    modes and where its Ray session went (run/test_faults_rows_and_files.py). {pid, returncode, stderr, run_dir,
    shared_sessions_before}."""
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("own-process")
    corpus = write_run_corpus(root / "corpus.jsonl", 16)
    config = root / "run.yaml"
    config.write_text("name: lines\n")
    run_dir = root / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR", "TMPDIR",
                                                            "PAGEFLEET_DISK_FULL_AT", "PAGEFLEET_CRASH_AT")}
    repo = Path(__file__).resolve().parents[2]
    env.update(PYTHONPATH=str(repo), JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled", PAGEFLEET_PROGRESS="1",
               PAGEFLEET_PROGRESS_EVERY_S="2")
    # Ray's OpenTelemetry metrics exporter thread has segfaulted the driver here on a loaded machine; no metrics.
    env["RAY_enable_metrics_collection"] = "0"
    # Sessions other processes left in the shared /tmp/ray (a later pid may be the same number as an old one's)
    shared_before = set(Path("/tmp/ray").glob("session_*"))
    with open(root / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(config),
                                 *run_args(run_model, corpus, run_dir, "--cluster.num_slices=4")],
                                cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: os.umask(0o027))
        try:
            proc.wait(timeout=800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"pid": proc.pid, "returncode": proc.returncode, "stderr": (root / "stderr.txt").read_text(),
            "run_dir": run_dir, "shared_sessions_before": shared_before}


def run_args(model: str, corpus: str, run_dir, *extra: str) -> list[str]:
    """Overrides for a small, quick run: batches of at most 8 prompts, 2 slices, no tracker."""
    return [f"--model.path={model}", "--model.dtype=float32", f"--corpus.path={corpus}", f"--run_dir={run_dir}",
            "--name=test", "--sampling.max_new_tokens=12", "--engine.max_seq_len=128", "--engine.page_size=8",
            "--engine.max_pages=96", "--engine.max_seqs=8", "--engine.max_seqs_in_prefill=4",
            "--engine.max_prefill_size=128", "--packing.max_prefill_steps=2", "--cluster.num_slices=2",
            "--cluster.local_num_cpus=2", "--tracker.type=noop", "--retry.backoff_s=0.05", *extra]


def free_ports(count: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head_env(tmp_path):
    """For a `ray start --head` of the test's own: an environment as a new user's shell has it (no RAY_ADDRESS,
    no RAY_AUTH_*), with HOME (where Ray keeps its token) and RAY_TMPDIR (where `ray start` records the cluster
    for `ray.init()`) private to the test, and the extra `ray start` options that keep its ports and temp dir apart
    from every other Ray on the machine. Yields (env, start_options, dashboard_port); kills only that cluster."""
    import shutil
    import sys
    import tempfile

    gcs, dashboard, client, agent, grpc, metrics, runtime_env = free_ports(7)
    temp = tempfile.mkdtemp(prefix="pf-")  # short: Ray's unix socket paths must stay under 108 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path / "home"), RAY_TMPDIR=temp, JAX_PLATFORMS="cpu",
               PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}")
    os.makedirs(env["HOME"], exist_ok=True)
    options = (f"--node-ip-address=127.0.0.1 --port={gcs} --num-cpus=2 --dashboard-host=127.0.0.1 "
               f"--dashboard-port={dashboard} --ray-client-server-port={client} --dashboard-agent-listen-port={agent} "
               f"--dashboard-agent-grpc-port={grpc} --metrics-export-port={metrics} "
               f"--runtime-env-agent-port={runtime_env} --temp-dir={temp}/ray --disable-usage-stats")
    try:
        yield env, options, dashboard
    finally:
        # Only this cluster's processes and their descendants: `ray stop` would stop every Ray on the machine.
        import psutil

        doomed = set()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if temp in cmdline or f"127.0.0.1:{gcs}" in cmdline:
                try:
                    doomed |= {proc, *proc.children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def tracker_summaries(monkeypatch) -> list[dict]:
    """The final summaries the run's tracker is given (`finish`), in a list filled as the run ends."""
    import orchestrator.observe.tracking as tracking
    import orchestrator.run.driver as driver

    finished, make = [], tracking.make_tracker

    def recording_tracker(*args, **kwargs):
        tracker = make(*args, **kwargs)
        tracker.finish = finished.append
        return tracker

    monkeypatch.setattr(driver, "make_tracker", recording_tracker)  # where the head calls it
    return finished
