"""lm-evaluation-harness through pagefleet: `PagefleetLM`, an `lm_eval.api.model.LM` registered as `pagefleet`.

Each of `loglikelihood`, `loglikelihood_rolling` and `generate_until` sends a whole task's requests to the engine in
one `pagefleet.generate` call (scored rows for the first two, sampled rows for the third), so the engine batches and
caches across them: the answer choices of a question share the question's KV pages (the prefix cache). Requests are
tokenized as lm-evaluation-harness's `hf` backend tokenizes them (`TemplateLM`'s context/continuation split, the
tokenizer's default special tokens unless the text already starts with the prefix token), so both backends score the
same token ids. Needs the `eval` extra (`pip install pagefleet[eval]`); docs/python-api.md shows its use.

lm-eval's command line finds models in its own registry only: `python -m pagefleet.evaluation ARGS` is `lm_eval ARGS`
with `--model pagefleet` registered.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import lm_eval.__main__
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from engine import Engine, EngineConfig
from orchestrator.local.generate import machine_sized_engine
from pagefleet.api import build_config, generate

_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
"""lm-eval generation kwargs (besides until, max_gen_toks and do_sample) and the sampling keys they set."""


@register_model("pagefleet")
class PagefleetLM(TemplateLM):
    """An lm-eval model over one pagefleet engine, built once (`model`: a checkpoint directory, or an Engine).

    `engine`: `engine.*` keys (docs/config.md) for the engine built here, the capacities not given sized for this
    machine (docs/performance.md); `max_gen_toks`: generate_until's default
    completion length; `max_length`: the longest scored window (default: the engine's max_seq_len - 1, one token
    being drawn after a continuation)."""

    def __init__(self, model: str | Engine, engine: Mapping[str, Any] | None = None, dtype: str = "float32",
                 max_gen_toks: int = 256, max_length: int | None = None, batch_size: Any = None,
                 max_batch_size: Any = None, device: Any = None, **engine_keys: Any) -> None:
        super().__init__()
        if isinstance(model, Engine):
            if engine or engine_keys:
                raise ValueError("engine keys configure a new engine; this Engine is already built")
            self.engine = model
        else:
            keys = {**dict(engine or {}), **engine_keys}  # `--model_args model=DIR,max_seqs=64` gives flat keys
            # The capacities not given are sized for this machine, as `pagefleet generate` sizes them (the
            # requests are not known yet: sequences up to max_seq_len).
            self.engine = machine_sized_engine(os.fspath(model), build_config(EngineConfig, keys, "engine"), dtype,
                                               frozenset(keys))
        if self.engine.tokenizer is None:
            raise ValueError("PagefleetLM needs the model's tokenizer (tokenizer files in the model directory)")
        self.tokenizer = self.engine.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length is not None else self.engine.max_seq_len - 1
        # lm-eval's --batch_size, --max_batch_size and --device are accepted and unused: a whole task is one call,
        # batched by the engine, on the devices JAX has.
        self.batch_size = batch_size

    # -- tokens, as the hf backend makes them ---------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}  # the text brings its own prefix token
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # -- the three request kinds ----------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, is_greedy) per (key, context ids, continuation ids), in one call.
        A window longer than max_length keeps its last max_length + 1 tokens, as the hf backend does."""
        rows = []
        for i, (_, context, continuation) in enumerate(requests):
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            num_context = len(whole) - len(continuation)
            if num_context < 1:
                raise ValueError(f"request {i}: a continuation of {len(continuation)} tokens leaves no context within "
                                 f"max_length={self.max_length}; raise engine.max_seq_len")
            rows.append({"id": i, "prompt_token_ids": whole[:num_context], "continuation_token_ids": whole[num_context:]})
        records = _checked(generate(self.engine, rows, max_new_tokens=1))
        return [(r["continuation_logprob"], r["is_greedy"]) for r in records]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over the hf backend's disjoint rolling windows, every window of every
        document in one call."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Completions of every request in one call, each with its own settings (a row's `sampling`)."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        rows = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks))
            until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=eos) if s and s != eos]
            max_new = int(kwargs.pop("max_gen_toks"))
            sampling: dict[str, Any] = {"max_new_tokens": max_new, "stop": until}
            if kwargs.pop("do_sample", False):
                sampling.update({_SAMPLING_KEYS[k]: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_KEYS})
            else:
                kwargs.pop("temperature", None)
            if kwargs:
                raise ValueError(f"generation kwargs {sorted(kwargs)} have no pagefleet setting; pagefleet takes "
                                 f"until, max_gen_toks, do_sample, {', '.join(_SAMPLING_KEYS)}")
            ids = self.tok_encode(context, left_truncate_len=self.max_length + 1 - max_new)
            rows.append({"id": i, "prompt_token_ids": ids, "sampling": sampling})
        return [r["completion"] for r in _checked(generate(self.engine, rows))]


def _checked(records: list[dict]) -> list[dict]:
    """The records, or the first error as one line (lm-eval has no place for a failed request)."""
    for r in records:
        if "error" in r:
            raise RuntimeError(f"request {r['prompt_id']}: {r['error']}")
    return records


if __name__ == "__main__":
    lm_eval.__main__.cli_evaluate()
