"""A deterministic byte-level BPE tokenizer, trained in-process, for randomly initialised models.

The training text is generated in code (pseudo-English words built from syllables, sentences with
punctuation and digits, code-like lines), so the same `vocab_size` always yields the same
tokenizer and nothing is downloaded. Byte-level pre-tokenizer and decoder: every unicode string
round-trips (`decode(encode(s)) == s`), except under the "qwen2" pipeline, which NFC-normalises
first (`decode(encode(s)) == NFC(s)`): transformers forces its own `Qwen2Tokenizer` on every
`model_type: qwen2` checkpoint and that class rebuilds the normaliser and pre-tokenizer (NFC plus
Qwen2's split regex) whatever tokenizer.json says, so we train with that same pipeline to keep
`tokenizers` and transformers in agreement. No post-processor: encoding never adds a BOS token on its
own; callers (or the chat template) add `BOS_TOKEN` where they want one.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END_TOKEN = "<|end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS, END_TOKEN)
"""Special tokens, in id order: they take ids 0..5 of every tokenizer built here."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""Jinja chat template: `<|role|>\\ncontent<|end|>\\n` per message, BOS first."""

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "st", "tr", "pl", "ch", "sh", "th", "br", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")
_CODE_KEYWORDS = ("def", "return", "if", "else", "for", "in", "while", "import", "class", "None")

Pipeline = Literal["byte_level", "qwen2"]
"""`byte_level`: GPT-2 style ByteLevel pre-tokenizer; `qwen2`: NFC, Qwen2's split regex, ByteLevel."""

# Copied from transformers.models.qwen2.tokenization_qwen2 (engine/ must not import transformers).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CORPUS_CHARS = 400_000
"""Size of the generated training text; enough for a vocabulary of several thousand tokens."""


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                   for _ in range(rng.choice((1, 1, 2, 2, 3))))


def training_corpus(num_chars: int = CORPUS_CHARS, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text of about `num_chars` characters, one entry per line."""
    rng = random.Random(seed)
    lexicon = [_word(rng) for _ in range(3000)]
    lines: list[str] = []
    total = 0
    while total < num_chars:
        kind = rng.random()
        if kind < 0.75:
            sentences = []
            for _ in range(rng.randint(1, 4)):
                words = [rng.choice(lexicon) for _ in range(rng.randint(3, 14))]
                if rng.random() < 0.2:
                    words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
                if rng.random() < 0.3:
                    words[rng.randrange(len(words))] += ","
                sentences.append(" ".join(words).capitalize() + rng.choice(".....?!:"))
            line = " ".join(sentences)
        else:
            name, arg = rng.choice(lexicon), rng.choice(lexicon)
            line = rng.choice((
                f"def {name}({arg}):\n    return {arg} + {rng.randint(0, 99)}",
                f"    {name} = [{arg}[i] for i in range({rng.randint(1, 64)})]",
                f"if {name} == {rng.randint(0, 9)}:\n        {arg}({name}, None)",
                f"{rng.choice(_CODE_KEYWORDS)} {name}.{arg}({rng.random():.3f})",
            ))
        lines.append(line + "\n")
        total += len(line) + 1
    return lines


def build_tokenizer(vocab_size: int, pipeline: Pipeline = "byte_level") -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` entries (special tokens included).

    Raises RuntimeError when the generated corpus has too few distinct merges to reach that size.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens plus {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    if pipeline == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {got} tokens, the model needs exactly {vocab_size}; "
            f"raise engine.tokenizer_builder.CORPUS_CHARS ({CORPUS_CHARS}) so training finds more merges"
        )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer


def write_tokenizer(output: str | os.PathLike, vocab_size: int, model_max_length: int,
                    pipeline: Pipeline = "byte_level") -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `output`.

    Returns the special-token ids `{"bos_token_id": ..., "eos_token_id": ...}` for the model config.
    """
    out = pathlib.Path(output)
    tokenizer = build_tokenizer(vocab_size, pipeline)
    tokenizer.save(str(out / "tokenizer.json"))
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        # Explicitly none: Qwen2Tokenizer would otherwise add an unknown "<|endoftext|>" token.
        "unk_token": None,
        "additional_special_tokens": [*ROLE_TOKENS, END_TOKEN],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return {"bos_token_id": tokenizer.token_to_id(BOS_TOKEN), "eos_token_id": tokenizer.token_to_id(EOS_TOKEN)}
