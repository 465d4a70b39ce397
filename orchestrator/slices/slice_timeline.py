"""The timeline a slice's results carry: its engine's steps folded into buckets of about TIMELINE_BUCKET_S, each
with its throughput, occupancy, device and host time, and the engine's counters (prefix cache, host KV, transfers,
programs compiled and loaded) over its steps. The head appends them to the run's timeline.jsonl
(orchestrator/observe/)."""

from __future__ import annotations

import time

from engine import PROGRAM_FIGURES, host_kv_counters, transfer_counters

TIMELINE_BUCKET_S = 1.0


class Timeline:
    """One engine's buckets, filled by the engine thread: a bucket closes after TIMELINE_BUCKET_S, and whenever a
    result leaves (`take`), so every step is in one bucket. Closing a bucket reads the engine's stats and clears
    them (only the last step is read between closes: a days-long run's memory stays flat)."""

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self._buckets: list[dict] = []
        # The bucket being filled: start (the first step's), steps, tokens, live sequences summed over steps.
        self._bucket = [0.0, 0, 0, 0]

    def add_step(self, stats, started: float, live_seqs: int, tokens: int) -> None:
        """Fold one step (begun at `started`) into the current bucket; `stats`: the engine's EngineStats."""
        b = self._bucket
        if not b[1]:
            b[0] = started  # a bucket spans steps only: an idle slice's wait is in none
        b[1] += 1
        b[2] += tokens
        b[3] += live_seqs
        if time.time() - b[0] >= TIMELINE_BUCKET_S:
            self.close(stats)

    def close(self, stats) -> None:
        b = self._bucket
        if b[1]:
            now = time.time()
            perf = stats.summary(self.max_seqs)  # the bucket's steps: cleared at each close
            self._buckets.append({"t": now, "steps": b[1], "tokens_per_s": b[2] / max(now - b[0], 1e-9),
                                  "occupancy": b[3] / b[1] / self.max_seqs,
                                  "device_s": perf.get("device_s", 0.0), "host_s": perf.get("host_s", 0.0),
                                  "prefix_cache_query_tokens": perf["prefix_cache_query_tokens"],
                                  "prefix_cache_hit_tokens": perf["prefix_cache_hit_tokens"],
                                  **host_kv_counters(perf),
                                  **{k: perf[k] for k in PROGRAM_FIGURES},  # what the bucket's steps compiled
                                  "decode_tokens": b[2],  # with the transfer counters: their bytes per token
                                  **transfer_counters(stats.device_to_host_bytes, stats.host_to_device_bytes)})
            self._bucket = [0.0, 0, 0, 0]
            stats.clear()  # only the last step is read here: keep a days-long run's memory flat

    def take(self, stats) -> list[dict]:
        """Every bucket so far, the current one closed: the steps so far travel with the result leaving now."""
        self.close(stats)
        buckets, self._buckets = self._buckets, []
        return buckets
