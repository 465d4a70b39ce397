"""Host-side stop handling for one sample: EOS ids, stop strings and max_new_tokens.

No JAX here: after each generated token id the engine shows the sample's ids to its `StopChecker`,
which detokenizes incrementally and says when and why the sample finished.

Conventions (the sample record of docs/records.md):
* `token_ids` are the generated ids up to and including the one that finished the sample: the EOS
  token, the stop token, or the token whose text completed a stop string. Nothing after it.
* `completion` is the text of those ids, cut at the start of the earliest stop-string occurrence
  (the stop string and everything after it are excluded); the text of an EOS or stop token is never
  included.
* `finish_reason` is `"stop"` for EOS, a stop token or a stop string (also when that happens at
  exactly `max_new_tokens`), and `"length"` when `max_new_tokens` ids were generated without one.
* With `min_tokens`, no stop string ends in the text of the first `min_tokens` ids (the engine's sampler holds the
  stop ids back until then, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder emits for an incomplete UTF-8 sequence; text ending in it is not trusted yet."""


@dataclass(frozen=True)
class StopDecision:
    """Why and where a sample finished."""

    finish_reason: Literal["stop", "length"]
    """`stop`: EOS, a stop token id or a stop string; `length`: max_new_tokens reached."""
    num_tokens: int
    """Generated token ids kept in the sample (`len(token_ids)`), the finishing token included."""
    completion: str
    """The completion text, the stop string and everything after it excluded."""


class StopChecker:
    """Incremental stop detection for one sample, told after each generated token id.

    The ids are not stored here: `push(token_ids)` receives the caller's list (the sample's one copy), whose
    generated ids start at index `start` (the prompt's length when the list holds the prompt too), each
    call with exactly one id more than the call before.

    `decode(ids) -> str` turns token ids into text (e.g. a Hugging Face tokenizer's `decode`). The
    text is built incrementally the way streaming detokenizers do it: the ids since the last point
    where the text was known to be complete are decoded together, and new text is trusted only when
    it does not end in U+FFFD, so a multi-byte character split across byte-level BPE tokens is
    seen only once complete (the characters before a trailing U+FFFD are final and are searched at
    once, so a stop string is caught on the token that completes it). When the sample ends on EOS,
    a stop id or the length limit, pending ids are decoded as they are (an unfinished character
    becomes U+FFFD). The text is that of the completion alone, as `decode(token_ids)` gives it
    (a SentencePiece decoder may drop the first token's leading space). Each push decodes O(window)
    ids and searches only the new text plus the last `longest stop string - 1` characters, so a
    sample costs O(length), not O(length^2). Without stop strings there is no text to watch: the
    ids are decoded once, when the sample ends (per-token decoding was most of the engine's host
    time on a fast device).
    """

    def __init__(
        self,
        *,
        stop_strings: Iterable[str] = (),
        eos_token_ids: Iterable[int] = (),
        max_new_tokens: int,
        decode: Callable[[list[int]], str],
        start: int = 0,
        min_tokens: int = 0,
    ) -> None:
        self._stop_strings = tuple(stop_strings)
        if any(not s for s in self._stop_strings):
            raise ValueError("an empty stop string would stop every sample at once; remove it from sampling.stop")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self._stopping_ids = frozenset(eos_token_ids)
        self._max_new_tokens = max_new_tokens
        self._min_tokens = min_tokens  # stop strings end only in the text of later ids (vLLM's min_tokens)
        self._decode = decode
        self._max_stop_len = max((len(s) for s in self._stop_strings), default=0)

        self._start = start  # generated id i is token_ids[start + i]
        self._ids: Sequence[int] = ()  # the generated ids (a view of the caller's list, see `_gen`)
        self._num_ids = 0  # generated ids seen
        self._text_ids = 0  # ids[:_text_ids] contribute text (an EOS / stop token does not)
        self._prefix_offset = 0  # ids[_prefix_offset:_read_offset] decode to the last trusted chunk
        self._read_offset = 0  # ids[:_read_offset] are fully reflected in _pieces
        self._pieces: list[str] = []  # trusted text, in order
        self._text_len = 0  # characters in _pieces
        self._tail = ""  # last (max_stop_len - 1) trusted characters, for matches across chunks
        self._decision: StopDecision | None = None

    @property
    def decision(self) -> StopDecision | None:
        """The finish decision, or None while the sample is still running."""
        return self._decision

    @property
    def completion(self) -> str:
        """The completion text; only defined once the sample finished."""
        if self._decision is None:
            raise RuntimeError("the completion is only known once push() returned a StopDecision")
        return self._decision.completion

    def push(self, token_ids: Sequence[int]) -> StopDecision | None:
        """Take the newest generated id (`token_ids[-1]`); returns the decision if it finished the sample."""
        if self._decision is not None:
            raise RuntimeError(f"push({token_ids[-1]}) after the sample finished ({self._decision.finish_reason}); "
                               "stop feeding a finished sample")
        if len(token_ids) - self._start != self._num_ids + 1:
            raise ValueError(f"push() expects one new id: had {self._num_ids}, got {len(token_ids) - self._start}")
        self._ids = token_ids
        self._num_ids += 1
        if token_ids[-1] in self._stopping_ids:
            return self._finish("stop", flush=True)
        self._text_ids = self._num_ids
        at_limit = self._num_ids >= self._max_new_tokens
        if not self._stop_strings:  # no text to watch: decode once, when the sample ends
            return self._finish("length", flush=True) if at_limit else None
        cut = self._advance_text(flush=at_limit)
        if cut is not None:
            return self._finish("stop", cut=cut)
        if at_limit:
            return self._finish("length")
        return None

    def _advance_text(self, *, flush: bool) -> int | None:
        """Decode the pending ids; returns the cut index if a stop string is now in the text.

        Without `flush`, new text ending in U+FFFD stays pending (an incomplete character may be
        finished by the next token), but the characters before it are final and are searched, so a
        stop string is caught on the token that completes it; with `flush`, whatever the ids decode
        to is taken as final.
        """
        if self._read_offset >= self._text_ids:
            return None
        prefix_text = self._decode(self._gen(self._prefix_offset, self._read_offset))
        # Decoding the previous chunk together with the new ids lets decoders that look at the
        # neighbouring token (e.g. SentencePiece's leading space) produce the in-context text.
        new_text = self._decode(self._gen(self._prefix_offset, self._text_ids))[len(prefix_text):]
        if flush or (new_text and not new_text.endswith(REPLACEMENT_CHAR)):
            self._prefix_offset, self._read_offset = self._read_offset, self._text_ids
            cut = self._find(new_text)
            self._append(new_text)
            return cut
        settled = new_text.rstrip(REPLACEMENT_CHAR)
        cut = self._find(settled)
        if cut is not None:
            self._append(settled)  # the sample ends here, so the pending characters never matter
        return cut

    def _gen(self, a: int, b: int) -> list[int]:
        """Generated ids a..b-1 (a slice of the caller's list)."""
        return list(self._ids[self._start + a:self._start + b])

    def _find(self, new_text: str) -> int | None:
        """Earliest start, in the whole text, of a stop string that ends inside `new_text`.

        Matches that end before `new_text` were looked for (and not found) on earlier pushes, so
        the last `longest stop string - 1` characters are all the context that is needed. None while the
        first `min_tokens` ids are all the sample has: as vLLM, a stop string must end in the text of a later id
        (it may begin before).
        """
        if not new_text or self._num_ids <= self._min_tokens:
            return None
        haystack = self._tail + new_text
        starts = [i for i in (haystack.find(s) for s in self._stop_strings) if i >= 0]
        return self._text_len - len(self._tail) + min(starts) if starts else None

    def _append(self, new_text: str) -> None:
        """Record final text."""
        self._pieces.append(new_text)
        self._text_len += len(new_text)
        if self._max_stop_len > 1:
            self._tail = (self._tail + new_text)[-(self._max_stop_len - 1):]

    def grammar_complete(self, decision: StopDecision | None) -> StopDecision:
        """The decision after the newest id (`push` returned `decision`) completed the sample's grammar, so that
        nothing more may follow: `stop`, even at max_new_tokens (a stop string found on the same id still cuts)."""
        if decision is None:
            return self._finish("stop", flush=True)
        if decision.finish_reason == "length":
            self._decision = StopDecision("stop", decision.num_tokens, decision.completion)
        return self._decision

    def _finish(self, reason: Literal["stop", "length"], *, cut: int | None = None,
                flush: bool = False) -> StopDecision:
        if flush:
            found = self._advance_text(flush=True)
            cut = found if cut is None else cut
        text = "".join(self._pieces)
        self._decision = StopDecision(reason, self._num_ids, text if cut is None else text[:cut])
        return self._decision
