"""engine/scheduling/stop.py: stop strings across token boundaries, split UTF-8, EOS ids and length."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.scheduling.stop import StopChecker, StopDecision

EOS, STOP_ID = 0, 1


class Fed:
    """A StopChecker beside the sample's id list, as the engine holds them (the checker keeps no copy)."""

    def __init__(self, **kwargs) -> None:
        self.ids: list[int] = []
        self.checker = StopChecker(**kwargs)

    def push(self, token: int) -> StopDecision | None:
        self.ids.append(token)
        return self.checker.push(self.ids)

    @property
    def token_ids(self) -> list[int]:
        """The kept ids: up to and including the finishing one."""
        decision = self.checker.decision
        return list(self.ids) if decision is None else self.ids[:decision.num_tokens]

    @property
    def completion(self) -> str:
        return self.checker.completion


# --- a handmade byte vocabulary: every id is an explicit byte string --------------------------

class ByteVocab:
    """Ids for explicit byte pieces, decoded like byte-level BPE (lossy UTF-8)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = [b"", b""]  # ids 0 and 1: EOS and a stop token, no text

    def ids(self, *pieces: bytes) -> list[int]:
        out = []
        for piece in pieces:
            self.pieces.append(piece)
            out.append(len(self.pieces) - 1)
        return out

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def run(vocab: ByteVocab, ids: list[int], stop: list[str] = (), max_new_tokens: int = 100,
        eos_token_ids: set[int] = frozenset({EOS})) -> tuple[Fed, StopDecision | None]:
    checker = Fed(stop_strings=stop, eos_token_ids=eos_token_ids, max_new_tokens=max_new_tokens, decode=vocab.decode)
    decision = None
    for token in ids:
        decision = checker.push(token)
        if decision is not None:
            break
    return checker, decision


@pytest.mark.parametrize(
    "pieces,stop,completion,kept",
    [
        ((b"ab", b"cENDx", b"yz"), ["END"], "abc", 2),  # inside one token
        ((b"ab", b"EN", b"Dx", b"yz"), ["END"], "ab", 3),  # spanning two tokens
        ((b"ab", b"E", b"N", b"D", b"yz"), ["END"], "ab", 4),  # spanning three tokens
        ((b"one", b"\n", b"\n", b"two"), ["\n\n"], "one", 3),  # "\n" + "\n"
        ((b"END", b"more"), ["END"], "", 1),  # at the very first token
        ((b"a\n\nbEND", b"c"), ["END", "\n\n"], "a", 1),  # several in one token: earliest wins
        ((b"xEN", b"D\n\n"), ["\n\n", "END"], "x", 2),  # several completed by one token
    ],
)
def test_stop_strings(pieces, stop, completion, kept):
    vocab = ByteVocab()
    ids = vocab.ids(*pieces)
    checker, decision = run(vocab, ids, stop)
    assert decision == StopDecision("stop", kept, completion)
    assert checker.token_ids == ids[:kept]  # up to and including the token that completed it
    assert checker.completion == completion


def test_multibyte_characters_split_across_tokens():
    vocab = ByteVocab()
    emoji, cjk = "😀".encode(), "中文".encode()  # 4 bytes, 2 x 3 bytes
    ids = vocab.ids(b"hi ", emoji[:1], emoji[1:3], emoji[3:] + cjk[:2], cjk[2:5], cjk[5:] + b"!", b"tail")
    checker, decision = run(vocab, ids, ["文!"])
    assert decision == StopDecision("stop", 6, "hi 😀中")
    # No stop: the whole text; a length cut inside a character decodes lossily, honestly.
    assert run(vocab, ids, ["zzz"], max_new_tokens=7)[1] == StopDecision("length", 7, "hi 😀中文!tail")
    assert run(vocab, ids, max_new_tokens=3)[1] == StopDecision("length", 3, "hi \ufffd")


def test_stop_string_made_of_split_characters():
    vocab = ByteVocab()
    emoji = "😀".encode()
    ids = vocab.ids(b"a", emoji[:2], emoji[2:], b"b")
    assert run(vocab, ids, ["😀"])[1] == StopDecision("stop", 3, "a")


def test_stop_is_caught_on_its_token_when_a_split_character_follows():
    vocab = ByteVocab()
    emoji = "😀".encode()
    ids = vocab.ids(b"xEN", b"D" + emoji[:2], emoji[2:], b"y")
    assert run(vocab, ids, ["END"])[1] == StopDecision("stop", 2, "x")


def test_eos_ids():
    vocab = ByteVocab()
    ids = vocab.ids(b"hello", b" world")
    checker, decision = run(vocab, [*ids, EOS, *ids])
    assert decision == StopDecision("stop", 3, "hello world")
    assert checker.token_ids == [*ids, EOS]  # the EOS id is kept, its text never is
    checker, decision = run(vocab, [ids[0], STOP_ID, ids[1]], eos_token_ids={EOS, STOP_ID})
    assert decision == StopDecision("stop", 2, "hello")


def test_eos_flushes_a_pending_split_character():
    vocab = ByteVocab()
    emoji = "😀".encode()
    ids = vocab.ids(b"a", emoji[:2])
    assert run(vocab, [*ids, EOS])[1] == StopDecision("stop", 3, "a\ufffd")


def test_max_new_tokens():
    vocab = ByteVocab()
    ids = vocab.ids(b"a", b"b", b"c", b"d")
    checker, decision = run(vocab, ids, ["zz"], max_new_tokens=3)
    assert decision == StopDecision("length", 3, "abc")
    assert checker.token_ids == ids[:3]
    # EOS or a stop string at exactly max_new_tokens is a stop.
    assert run(vocab, [*ids[:2], EOS], max_new_tokens=3)[1] == StopDecision("stop", 3, "ab")
    assert run(vocab, ids, ["bc"], max_new_tokens=3)[1] == StopDecision("stop", 3, "a")
    assert run(vocab, ids[:1], max_new_tokens=1)[1] == StopDecision("length", 1, "a")


def test_misuse_names_the_fix():
    vocab = ByteVocab()
    checker, _ = run(vocab, vocab.ids(b"a"), max_new_tokens=1)
    with pytest.raises(RuntimeError, match="finished"):
        checker.push(2)
    with pytest.raises(ValueError, match="empty stop string"):
        StopChecker(stop_strings=[""], max_new_tokens=5, decode=vocab.decode)
    with pytest.raises(RuntimeError, match="once push"):
        StopChecker(max_new_tokens=5, decode=vocab.decode).completion


# --- a real byte-level BPE tokenizer trained on generated text ------------------------------

ALPHABET = "abcdeEND \n.,!中文字😀🎉é"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    words = ["the", "end", "END", "stop", "中文", "字", "😀", "🎉", "café", "\n\n", "and", "a.b"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    assert tok.token_to_id("<eos>") == EOS
    return tok


def _bpe_run(tok: Tokenizer, text: str, stop: list[str]) -> tuple[list[int], Fed, StopDecision]:
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text  # byte-level BPE round-trips any text
    checker = Fed(stop_strings=stop, eos_token_ids={EOS}, max_new_tokens=len(ids) + 1,
                          decode=tok.decode)
    decision = None
    for token in [*ids, EOS]:
        decision = checker.push(token)
        if decision is not None:
            break
    assert decision is not None
    return ids, checker, decision


def test_bpe_splits_rare_characters_and_still_stops(tokenizer):
    text = "the end 🦀🦀 and 中文\n\nstop here"  # the crab is unseen: its bytes are separate tokens
    ids = tokenizer.encode(text).ids
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    _, checker, decision = _bpe_run(tokenizer, text, ["\n\n", "stop"])
    assert decision.finish_reason == "stop"
    assert decision.completion == "the end 🦀🦀 and 中文"
    _, _, decision = _bpe_run(tokenizer, text, ["🦀"])
    assert decision.completion == "the end "
    _, checker, decision = _bpe_run(tokenizer, text, ["nowhere"])
    assert decision == StopDecision("stop", len(ids) + 1, text)  # ended by EOS
    assert checker.token_ids == [*ids, EOS]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET + "🦀ü", max_size=40), data=st.data())
def test_bpe_completion_is_text_before_the_stop(tokenizer, text, data):
    if text and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(text) - 1))
        stop = text[start:data.draw(st.integers(start + 1, len(text)))]
    else:
        stop = data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=4))
    ids, checker, decision = _bpe_run(tokenizer, text, [stop])
    kept = checker.token_ids
    if stop in text:
        cut = text.index(stop)
        assert decision.completion == text[:cut]
        # The kept ids end with the token that completed the stop string, not later.
        assert kept == ids[:len(kept)]
        assert tokenizer.decode(kept).startswith(text[:cut + len(stop)])
        assert stop not in tokenizer.decode(kept[:-1]).rstrip("\ufffd")
    else:
        assert decision.completion == text
        assert kept == [*ids, EOS]
    assert decision.finish_reason == "stop" and decision.num_tokens == len(kept)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET + "🦀ü", max_size=40), data=st.data())
def test_without_stop_strings_the_text_is_decoded_once(tokenizer, text, data):
    """No stop string to watch: one decode when the sample ends (not two per token), and the same completion
    as the incremental path gives, whether EOS ends it or the length limit cuts a character in two."""
    ids = tokenizer.encode(text).ids
    limit = data.draw(st.integers(1, len(ids) + 1))
    calls = []

    def counted(token_ids: list[int]) -> str:
        calls.append(len(token_ids))
        return tokenizer.decode(token_ids)

    def finish(stop: list[str], decode) -> StopDecision:
        checker = Fed(stop_strings=stop, eos_token_ids={EOS}, max_new_tokens=limit, decode=decode)
        for token in [*ids, EOS]:
            if (decision := checker.push(token)) is not None:
                return decision
        raise AssertionError("the sample did not finish")

    got = finish([], counted)
    assert len(calls) <= 2  # the whole text, and the empty prefix before it
    assert got == finish(["\x00"], tokenizer.decode)  # a stop string that never occurs: the incremental path
    assert got.completion == tokenizer.decode(([*ids, EOS][:limit])[:len(ids)])
    assert got.finish_reason == ("stop" if limit == len(ids) + 1 else "length")
