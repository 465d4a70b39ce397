"""One JSON row of a corpus line as planning and `pagefleet generate` both read it: parsed as `json.loads` parses
it (`loads_row`), and refused when an escape in it is a lone surrogate (`lone_surrogate`)."""

from __future__ import annotations

import codecs
import json
import re

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def may_hold_lone_surrogate(text: str) -> bool:
    """Whether `text` (a row, or many) holds an escape that may decode to a lone surrogate: `lone_surrogate`'s cheap
    test, which a shard's text passes once instead of each of its rows."""
    return _SURROGATE_ESCAPE.search(text) is not None


def lone_surrogate(text: str) -> str | None:
    """Why a row's JSON text cannot be used, when an escape in it decodes to a lone surrogate ("\\ud800": no
    character, so no UTF-8 for the tokenizer or the output files), else None. A surrogate pair is a character."""
    if not may_hold_lone_surrogate(text):  # the cheap test first: almost every row has no such escape
        return None
    try:
        json.dumps(json.loads(text), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"row holds a lone surrogate ({e.object[e.start:e.end].encode('unicode_escape').decode()}), which "
                "is no character; fix the row's text (write the character, or a complete surrogate pair)")
    return None


def without_bom(head: bytes) -> bytes:
    """A file's first bytes without the UTF-8 byte order mark some editors write (Notepad, PowerShell's UTF-8):
    JSON has none, and the file's first row would read as malformed."""
    return head[len(codecs.BOM_UTF8):] if head.startswith(codecs.BOM_UTF8) else head


_DECODER = json.JSONDecoder()


def loads_row(text: str):
    """`json.loads(text)`; a row nested too deeply for the parser (100,000 levels) raises ValueError, as any row
    that is not usable JSON does, instead of RecursionError."""
    try:  # json.loads less its two whitespace regexes (a third of its time): the same value for a text that is
        record, end = _DECODER.raw_decode(text)  # one JSON value from its first character to its last
        if end == len(text):
            return record
    except (ValueError, RecursionError):  # json.loads says why below, in its own words
        pass
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("the row is nested too deeply to read") from None
