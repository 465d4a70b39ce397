"""One host process of a multi-host slice test (run by tests/engine/test_multihost.py, not by pytest).

`run` mode: join the slice (or, with --num-processes 1, run alone on one device as the reference),
then for each (model directory, mesh `model` size) pair build an Engine and generate the same
requests, greedy and seeded; write token ids, logprobs, snapshot and stats counts as JSON.
`agree` mode: make the hosts disagree on purpose and record the errors each host raised.
`swap` mode: a pool too small for the workload under preemption `recompute` and `swap` (with a host pool and
the prefix cache's host tier) and an ample pool; record each one's samples, page moves and figures.
`load` mode: load a gs:// checkpoint by ranged reads; record whether this host's shards equal the local load's
and the bytes it read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def requests(vocab: int):
    import numpy as np

    from engine.config import SamplingConfig
    from engine.scheduling.sequence import Request

    rng = np.random.default_rng(7)
    lengths = [1, 7, 8, 9, 30, 70]  # page_size 8: partial and full last pages, several prefill chunks
    greedy = SamplingConfig(max_new_tokens=8, temperature=0.0, logprobs=True)
    seeded = SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3, n=2, logprobs=True)
    out = [Request(f"g{i}", tuple(rng.integers(6, vocab, n).tolist()), greedy) for i, n in enumerate(lengths)]
    for i, n in enumerate(lengths):
        prompt = tuple(rng.integers(6, vocab, n).tolist())
        out += [Request(f"s{i}", prompt, seeded, g) for g in range(seeded.n)]
    return out


def engine_config(max_pages: int = 96):
    from engine.config import EngineConfig

    # 4 slots and 16-token steps: few distinct step shapes (each costs seconds to compile on CPU)
    return EngineConfig(page_size=8, max_pages=max_pages, max_seqs=4, max_seqs_in_prefill=4, max_prefill_size=16,
                        max_seq_len=256)


def run(args) -> dict:
    from engine.distributed import slice_mesh
    from engine.engine import Engine

    results = {}
    for spec in args.model:
        path, model_axis = spec.rsplit(":", 1)
        mesh = None if args.num_processes == 1 else slice_mesh(int(model_axis))
        engine = Engine(path, engine_config(), mesh=mesh)
        out = engine.generate(requests(engine.model_config.vocab_size), reset=False)
        stats = engine.stats
        results[spec] = {
            "token_ids": [c.token_ids for c in out],
            "logprobs": [c.logprobs for c in out],
            "snapshot": engine.snapshot(),
            "stats": {"steps": len(stats.step_s), "prefill_tokens": stats.prefill_tokens,
                      "decode_tokens": stats.decode_tokens, "active_seqs": stats.active_seqs},
        }
        engine.reset("physical")  # a compiled call too: every host must make it
        results[spec]["snapshot_after_reset"] = engine.snapshot()
    return results


def swap(args) -> dict:
    """A device pool too small for the workload on the slice, under preemption `recompute` and `swap` (with the
    prefix cache's host tier), and an ample pool: each one's samples, figures and page moves, step by step."""
    import numpy as np

    from engine.config import EngineConfig, SamplingConfig
    from engine.distributed import slice_mesh
    from engine.engine import Engine
    from engine.scheduling.sequence import Request

    path, model_axis = args.model[0].rsplit(":", 1)
    rng = np.random.default_rng(11)
    greedy = SamplingConfig(max_new_tokens=24, temperature=0.0, logprobs=True)
    seeded = SamplingConfig(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=6, n=2, logprobs=True)
    x, y = (tuple(rng.integers(6, 512, 17).tolist()) for _ in range(2))  # two full pages of 8, and a token

    def on(prefix, name, sampling, count=2):
        prompts = [prefix + tuple(rng.integers(6, 512, int(rng.integers(1, 9))).tolist()) for _ in range(count)]
        return [Request(f"{name}{i}", p, sampling, g) for i, p in enumerate(prompts) for g in range(sampling.n)]

    batch = [Request(f"g{i}", tuple(rng.integers(6, 512, int(rng.integers(4, 20))).tolist()), greedy) for i in range(3)]
    # Three calls: swaps (a pool too small), prompts on y reclaiming x's cached pages (spilled to the host tier),
    # then prompts on x (paged back in from the host tier) while a prompt runs.
    calls = [batch + on(x, "s", seeded), on(y, "y", greedy, 3), [batch[0], *on(x, "x", greedy)]]
    results = {}
    for name, engine in {"ample": dict(max_pages=200), "recompute": dict(max_pages=12, preemption="recompute"),
                         "swap": dict(max_pages=12, preemption="swap", host_kv_pages=64)}.items():
        eng = Engine(path, EngineConfig(page_size=8, max_seqs=4, max_seqs_in_prefill=2, max_prefill_size=16,
                                        max_seq_len=64, debug_invariants=True, **engine),
                     mesh=slice_mesh(int(model_axis)))
        moves, run, tier, page_in_hits = [], eng.runner.run, [], eng.scheduler.swapper.page_in_hits
        eng.runner.run = lambda out: (moves.append([out.swap_out, out.swap_in, out.swap_in_ahead]), run(out))[1]
        eng.scheduler.swapper.page_in_hits = lambda hits, *a: (tier.append(len(hits)), page_in_hits(hits, *a))[1]
        samples, names = [], ("kv_pages_out", "kv_pages_in", "kv_pages_in_ahead", "recompute_tokens",
                              "recompute_avoided_tokens")
        stats = dict.fromkeys((*names, "host_kv_pages_peak"), 0)
        for call in calls:
            out = eng.generate(call)  # each call's figures start from 0: summed over the calls here
            assert all(c.error is None for c in out), [c.error for c in out]
            samples.append({f"{c.prompt_id}/{c.generation_index}": [c.token_ids, c.logprobs] for c in out})
            stats.update({k: stats[k] + getattr(eng.stats, k) for k in names})
            stats["host_kv_pages_peak"] = max(stats["host_kv_pages_peak"], eng.stats.host_kv_pages_peak)
        results[name] = {"samples": samples, "moves": moves, "preemptions": eng.scheduler.num_preemptions,
                         "host_tier_pages_in": sum(tier),
                         "fallbacks": eng.scheduler.swapper.num_fallbacks,
                         "stats": stats,
                         "host_share": sum(np.prod(a.shape[1:]) for a in eng.runner.kv.host.shards.values())
                         / np.prod(eng.runner.kv.pool.array.shape[1:])}  # of each page, this host's host pool holds
    return results


def load(args) -> dict:
    """Load `--model URL:MODEL_AXIS` from the bucket (ranged reads, no merging of ranges) and from `--local DIR`; say
    whether this host's shards are equal and how many bytes it read against the bytes of its shards."""
    import jax
    import numpy as np

    from engine.distributed import slice_mesh
    from engine.models.weights import load_transformer

    url, model_axis = args.model[0].rsplit(":", 1)
    mesh = slice_mesh(int(model_axis))
    report: dict = {}
    remote = load_transformer(url, mesh=mesh, report=report, merge_gap=0)
    local = load_transformer(args.local, mesh=mesh)
    equal, shard_bytes = True, 0
    for x, y in zip(jax.tree_util.tree_leaves(remote), jax.tree_util.tree_leaves(local)):
        for sx, sy in zip(x.addressable_shards, y.addressable_shards):
            equal &= sx.device == sy.device and sx.index == sy.index and np.array_equal(sx.data, sy.data)
            shard_bytes += sx.data.nbytes  # one device per host: no shard counted twice
    return {"equal": bool(equal), "bytes_read": report["bytes_read"], "shard_bytes": int(shard_bytes)}


def disagree(args) -> dict:
    """Three ways for process 1 to differ; each must raise on every host, naming what differs."""
    import jax

    from engine.distributed import HostsDisagree, agree, slice_mesh
    from engine.engine import Engine

    path = args.model[0].rsplit(":", 1)[0]
    odd = jax.process_index() == 1
    mesh = slice_mesh(1)  # (data 4, model 1): spans both processes
    errors = {}
    try:  # 1. a different engine config, caught before the weights or the KV pool exist
        Engine(path, engine_config(max_pages=97 if odd else 96), mesh=mesh)
    except HostsDisagree as e:
        errors["engine_config"] = str(e)
    engine = Engine(path, engine_config(), mesh=mesh)
    batch = requests(engine.model_config.vocab_size)
    if odd:  # 2. the same config but a different batch, caught before the first step
        batch = batch[1:] + batch[:1]
    try:
        engine.generate(batch)
    except HostsDisagree as e:
        errors["requests"] = str(e)
        errors["steps_run"] = len(engine.stats.step_s)
        engine.abort()
    try:  # 3. different sets of keys: a fixed-shape first round, so no host hangs
        agree({"a": "1", **({"b": "2"} if odd else {})})
    except HostsDisagree as e:
        errors["keys"] = str(e)
    # Without a mesh each process runs its own engine on its own device (no agreement needed), here on
    # batches that differ between the hosts.
    local = Engine(path, engine_config()).generate(requests(512)[1 if odd else 0:][:2])
    errors["local_token_ids"] = [c.token_ids for c in local]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["run", "agree", "load", "swap"], default="run")
    parser.add_argument("--local", default="", help="load mode: the local copy of --model")
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=1)
    parser.add_argument("--model", action="append", required=True, help="DIR:MODEL_AXIS (repeatable)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from engine import distributed

    if args.num_processes > 1:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, args.local_devices)
    else:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    result = {"run": run, "agree": disagree, "load": load, "swap": swap}[args.mode](args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
