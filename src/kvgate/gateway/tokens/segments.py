"""Token ids of repeated text, remembered: prompts repeat, so most of their text is not new.

System prompts, chat histories (each turn resends all the turns before it) and documents
shared by many requests repeat from one request to the next. `SegmentCache` cuts a text
where its tokenizer provably cuts it anyway, at a newline between two non-space characters
(kvgate.gateway.tokens.bpe, `splits_at_lines`), and remembers each segment's ids: a
segment seen before costs a dictionary look-up instead of an encoding. Only the new
segments are encoded. For a tokenizer that cannot be cut there, the whole text is the one
segment (a repeated prompt is still a hit).

Cutting is a regular-expression split on a literal newline followed by a non-space
character (a few microseconds per thousand tokens); a cut whose newline follows a space is
not safe (the space and the newline may be one piece) and is joined back.

Memory is bounded by the tokens remembered: two generations of at most `max_tokens / 2`
each; when the young one is full it becomes the old one and the old one is dropped, so a
segment used in the last generation survives and one unused for two is forgotten.
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: Where a cut may fall: the newline before a non-space character (the newline is removed
#: by the split and put back at the end of the segment before it).
_LINES = re.compile(r"\n(?=\S)")
#: Tokens remembered per model by default (about 40 MB of Python ints at the most).
DEFAULT_MAX_TOKENS = 1_000_000


class SegmentCache:
    """`encode(text)`: the text's ids, from remembered segments where possible."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        *,
        split: bool,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self._encode = encode
        self.split = split
        self._half = max(1, max_tokens // 2)
        # Keys: a segment's text without its final newline for segments that end with one
        # (`_lines`), the text itself for the last segment of a text (`_tails`).
        self._young: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        self._old: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        self._size = 0
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        if not self.split:
            return list(self._get(text, 1))
        pieces = _LINES.split(text)
        if len(pieces) == 1:
            return list(self._get(text, 1))
        out: list[int] = []
        held = ""  # pieces whose cut was not safe, waiting to be joined to the next
        for piece in pieces[:-1]:
            if not piece or piece[-1].isspace():
                held += piece + "\n"
                continue
            if held:
                piece, held = held + piece, ""
            out += self._get(piece, 0)
        out += self._get(held + pieces[-1], 1)
        return out

    def _get(self, key: str, kind: int) -> list[int]:
        ids = self._young[kind].get(key)
        if ids is not None:
            self.hits += 1
            return ids
        ids = self._old[kind].get(key)
        if ids is None:
            self.misses += 1
            ids = self._encode(key + "\n" if kind == 0 else key)
        else:
            self.hits += 1
        self._young[kind][key] = ids
        self._size += len(ids) + 1
        if self._size > self._half:
            self._old, self._young, self._size = self._young, ({}, {}), 0
        return ids

    def clear(self) -> None:
        self._young, self._old, self._size = ({}, {}), ({}, {}), 0
