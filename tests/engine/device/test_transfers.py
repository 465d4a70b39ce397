"""The transfer ledger (engine/device/transfers.py): the engine loop's only host-device transfers are the ledger's.

JAX's transfer guard catches implicit host-to-device copies on every backend, but on CPU it does not see a
device-to-host read: a CPU array already lives in host memory, and numpy reads it in place (no copy, so no
check). `only_ledger_transfers` makes the CPU check it the way an accelerator does: every read that goes
through `jax.Array._value` (np.asarray of an array on several devices, tolist, float, int, bool, format)
fails unless JAX's own device-to-host guard allows it where it runs (the ledger's `read`). A single-device
CPU array also offers numpy its memory directly, past any check: the loop runs on a two-device mesh here,
where every output the host reads is replicated over both devices and has no such shortcut.
"""

from __future__ import annotations

import dataclasses

import logging
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import config as jax_config  # the effective (thread-local) guard level: no public accessor
from jax._src.array import ArrayImpl
from jax.sharding import Mesh

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.sizing.model_bytes import kv_bytes_per_token
from engine.models.presets import write_model
from engine.device.runner import ModelRunner
from engine.scheduling.sequence import Request
from engine.trace import traces

DISALLOWED = r"Disallowed (device-to-host|host-to-device) transfer"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


@contextmanager
def only_ledger_transfers():
    """`jax.transfer_guard("disallow")`, with its device-to-host half enforced on CPU too (module docstring)."""
    value = ArrayImpl.__dict__["_value"]

    def guarded(self):
        if jax_config.transfer_guard_device_to_host.value in ("disallow", "disallow_explicit"):
            raise RuntimeError(f"Disallowed device-to-host transfer: {self.aval} outside the transfer ledger")
        return value.fget(self)

    ArrayImpl._value = property(guarded)
    try:
        with jax.transfer_guard("disallow"):
            yield
    finally:
        ArrayImpl._value = value


def two_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))


def requests(sampling: SamplingConfig, lengths=(5, 40, 70)) -> list[Request]:
    """`sampling.n` samples of each prompt (they fork off their prompt's pages)."""
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(6, 500, n).tolist()) for n in lengths]
    return [Request(f"p{i}", p, sampling, generation_index=g) for i, p in enumerate(prompts) for g in range(sampling.n)]


# Every kind of device call: chunked prompts (max_prefill_size 32), n samples forking (a page copy), multi-step
# decode calls chained ahead of the host's read, greedy and sampled rows.
CONFIG = EngineConfig(page_size=8, max_pages=96, max_seqs=8, max_prefill_size=32, max_seq_len=256, decode_steps=4)
SAMPLINGS = [SamplingConfig(max_new_tokens=12, temperature=0.0, n=2, logprobs=True),
             SamplingConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, n=2, seed=4, logprobs=True)]


@pytest.mark.parametrize("mesh", [None, "two devices"])
def test_the_engine_loop_runs_with_only_the_ledgers_transfers(tiny_llama, mesh):
    """Under the guard the loop gives the samples it gives without it (on one device and on a mesh), and the
    ledger counted what crossed: tokens, logprobs and step counts out; inputs, page tables, sampling settings
    and a fork's page copy in."""
    engine = Engine(tiny_llama, CONFIG, mesh=None if mesh is None else two_device_mesh())
    for sampling in SAMPLINGS:
        free = engine.generate(requests(sampling))
        with only_ledger_transfers():
            guarded = engine.generate(requests(sampling))
        assert [(r.token_ids, r.logprobs) for r in guarded] == [(r.token_ids, r.logprobs) for r in free]
        s = engine.stats.summary(CONFIG.max_seqs)
        assert min(s[f"device_to_host_bytes_{c}"] for c in ("tokens", "logprobs", "steps")) > 0
        assert s["device_to_host_bytes_logits"] == s["device_to_host_bytes_swap"] == 0
        sent = ("step_inputs", "page_tables", "sampling", "page_copies")
        assert min(s[f"host_to_device_bytes_{c}"] for c in sent) > 0


@pytest.mark.parametrize("mesh", [None, "two devices"])
def test_swap_preemption_moves_pages_only_through_the_ledger(tiny_llama, mesh):
    """A pool that preempts, engine.preemption=swap: under the guard the samples are those it gives without it
    (the pool sharded over the mesh's two devices too), and the pages moved are the ledger's `swap` bytes."""
    config = dataclasses.replace(CONFIG, max_pages=32, max_seqs=6, max_seqs_in_prefill=6, host_kv_pages=64,
                                 preemption="swap")
    engine = Engine(tiny_llama, config, mesh=None if mesh is None else two_device_mesh())
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.9, seed=4, n=2, logprobs=True)
    free = engine.generate(requests(sampling), reset=True)  # the second call then schedules as the first did
    with only_ledger_transfers():
        guarded = engine.generate(requests(sampling))
    assert [(r.token_ids, r.logprobs) for r in guarded] == [(r.token_ids, r.logprobs) for r in free]
    s = engine.stats.summary(config.max_seqs)
    assert s["kv_pages_out"] > 0 and s["recompute_tokens"] == 0
    assert s["device_to_host_bytes_swap"] > 0 and s["host_to_device_bytes_swap"] > 0


def _read_implicitly(runner: ModelRunner, pending) -> None:
    np.asarray(pending.tokens)  # what the runner did before its reads went through the ledger


def _read_a_scalar(runner: ModelRunner, pending) -> None:
    int(jnp.max(pending.steps))  # the max is computed on the device; int() reads it


def _send_implicitly(runner: ModelRunner, pending) -> None:
    jax.jit(lambda x: x + 1)(np.ones(4, np.int32))  # a host array handed to a jitted call outside `sending`


@pytest.mark.parametrize("inject", [_read_implicitly, _read_a_scalar, _send_implicitly])
def test_an_implicit_transfer_in_the_loop_fails(tiny_llama, monkeypatch, inject):
    engine = Engine(tiny_llama, CONFIG, mesh=two_device_mesh())
    fetch = ModelRunner.fetch_multi_step

    def fetch_with_a_stray_transfer(self, pending):
        inject(self, pending)
        return fetch(self, pending)

    monkeypatch.setattr(ModelRunner, "fetch_multi_step", fetch_with_a_stray_transfer)
    with only_ledger_transfers(), pytest.raises(Exception, match=DISALLOWED):
        engine.generate(requests(SAMPLINGS[0]))
    engine.abort()


def test_device_to_host_bytes_per_generated_token_do_not_grow_with_the_context(tiny_llama):
    """A prompt of 16 tokens and one of 1,000 (one prompt chunk each), 32 greedy tokens: the same calls read
    the same bytes, a few dozen a token. The KV pool (here 512 bytes a token of context) never crosses."""
    config = EngineConfig(page_size=16, max_pages=80, max_seqs=4, max_prefill_size=1024, max_seq_len=1100)
    engine = Engine(tiny_llama, config)
    sampling = SamplingConfig(max_new_tokens=32)
    rng = np.random.default_rng(3)
    figures = {}
    for n in (16, 1000):
        (record,) = engine.generate([Request(f"len{n}", tuple(rng.integers(6, 500, n).tolist()), sampling)])
        assert record.finish_reason == "length"  # same tokens generated: a per-token figure compares like with like
        figures[n] = engine.stats.summary(config.max_seqs)
    short, long = figures[16], figures[1000]
    assert long["device_to_host_bytes"] == short["device_to_host_bytes"] > 0
    assert long["device_to_host_bytes_per_token"] == short["device_to_host_bytes_per_token"] < 100
    assert long["device_to_host_bytes"] < kv_bytes_per_token(engine.model_config, 4) * 16  # not one page's KV
    assert long["host_to_device_bytes"] > short["host_to_device_bytes"]  # the prompt itself does go in


def test_the_transfers_trace_logs_each_device_call_and_nothing_else(tiny_llama, monkeypatch, caplog):
    sampling = SamplingConfig(max_new_tokens=6)
    root_level = logging.getLogger().level
    caplog.set_level(logging.DEBUG)  # everything any logger emits: the ledger must emit nothing unasked
    Engine(tiny_llama, CONFIG).generate(requests(sampling))
    assert not [r for r in caplog.records if r.name == "pagefleet.transfers"]
    caplog.clear()
    caplog.set_level(logging.WARNING)  # the root logger back at its default: a trace must not need it lower
    caplog.handler.setLevel(logging.NOTSET)  # caplog's handler then keeps what reaches it
    monkeypatch.setenv("PAGEFLEET_TRACE", "transfers")
    engine = Engine(tiny_llama, CONFIG)
    engine.generate(requests(sampling))
    lines = [r.getMessage() for r in caplog.records if r.name == "pagefleet.transfers"]
    assert len(lines) == engine.stats.summary(CONFIG.max_seqs)["steps"] > 1  # one line a device call
    assert all(r.name == "pagefleet.transfers" for r in caplog.records)  # and nothing else turned on
    assert logging.getLogger().level == root_level
    assert lines[0].startswith("device call 1: device_to_host ") and "(tokens " in lines[0]
    assert "host_to_device " in lines[0] and "page_tables " in lines[0]
    assert any("steps " in line for line in lines)  # a multi-step decode call's per-row step counts


def test_an_unknown_trace_is_refused_in_one_line_naming_the_valid_ones(tiny_llama, monkeypatch, capsys):
    from orchestrator.commands.cli import main
    from orchestrator.exit_codes import FAULT

    assert traces({"PAGEFLEET_TRACE": " transfers, "}) == {"transfers"} and traces({}) == frozenset()
    monkeypatch.setenv("PAGEFLEET_TRACE", "transfers,kv")
    with pytest.raises(ValueError, match=r"PAGEFLEET_TRACE='transfers,kv' names no trace 'kv'; valid: transfers"):
        Engine(tiny_llama, CONFIG)
    assert main(["status", str(tiny_llama)]) == FAULT  # refused before the command runs
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "valid: transfers" in err


@pytest.mark.parametrize("mesh", [None, "two devices"])
def test_structured_outputs_send_their_masks_through_the_ledger(tiny_llama, mesh):
    """Constrained rows beside unconstrained ones: under the guard the samples are those given without it, and the
    allowed-token bitmasks are the ledger's `token_mask` bytes: 4 bytes per 32 vocabulary entries of a step's rows."""
    engine = Engine(tiny_llama, CONFIG, mesh=None if mesh is None else two_device_mesh())
    choice = SamplingConfig(max_new_tokens=12, temperature=0.9, seed=2, n=2, logprobs=True, choice=["yes", "no"])
    mixed = requests(choice) + requests(SAMPLINGS[0], lengths=(9, 30))
    mixed = [dataclasses.replace(r, prompt_id=f"{r.prompt_id}-{i // 6}") for i, r in enumerate(mixed)]
    free = engine.generate(mixed)
    with only_ledger_transfers():
        guarded = engine.generate(mixed)
    assert [(r.token_ids, r.logprobs) for r in guarded] == [(r.token_ids, r.logprobs) for r in free]
    assert all(r.completion in ("yes", "no") for r in guarded[:6])
    s = engine.stats.summary(CONFIG.max_seqs)
    words = -(-engine.vocab_size // 32)
    assert s["host_to_device_bytes_token_mask"] > 0 and s["host_to_device_bytes_token_mask"] % (4 * words) == 0
