"""A byte-level BPE tokenizer converted to `tiktoken`: the same ids, at a quarter of the CPU.

Most chat models' tokenizers (GPT-2's lineage: Llama 3, Qwen, Mistral's Tekken, the
tiny model of the real-engine tests) are byte-level BPE: a regular expression cuts the text
into pieces, each piece's bytes are merged pairwise by rank. `tiktoken` does exactly that in
Rust, and with the vocabulary's ids as ranks (a merge's product has a higher id than its
parts in these vocabularies) it gives the ids `tokenizers` gives, measured at about a
quarter of the CPU (benchmarks/cost_exact).

`convert` builds the `tiktoken` encoding only for a `tokenizer.json` of that shape (a BPE
model with no byte fallback, subword affixes or normalizer; a `ByteLevel` pre-tokenizer
with its own regex, or a `Split` by a regex followed by a `ByteLevel` without one; no prefix
space; added tokens matched as they are written). Anything else answers None. Even then
the conversion is only a candidate: the caller (kvgate.gateway.tokens.model) uses it only
after it gave the reference tokenizer's ids on a validation corpus.

`splits_at_lines`: the pre-tokenizer's regex is one of the GPT-2, Llama 3 (cl100k) or
Qwen 2 patterns, under which a newline between two non-space characters always ends a
piece: no alternative of those patterns continues past such a newline (letters and digits
never start with one, runs of punctuation and of newlines stop before a non-space, and the
lookahead `(?!\\S)` looks one character ahead only), and none has an anchor or lookbehind.
So the text before and after such a newline encode independently to the same ids
(kvgate.gateway.tokens.segments), as long as no added token contains a newline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: GPT-2's pre-tokenizer pattern (a `ByteLevel` pre-tokenizer with `use_regex`).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Llama 3's and cl100k's pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen 2's: Llama 3's with one digit per piece.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LINE_SAFE = frozenset({GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN})

Encode = Callable[[str], list[int]]


class Converted:
    """A `tiktoken` encoding of a `tokenizer.json`, and what is known of its pattern."""

    def __init__(self, encode: Encode, pattern: str, newline_in_added: bool) -> None:
        self.encode = encode
        self.pattern = pattern
        self.splits_at_lines = pattern in _LINE_SAFE and not newline_in_added


def pattern_of(spec: dict[str, Any]) -> str | None:
    """The regex a byte-level pre-tokenizer cuts text with, or None when it is not one."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if split.get("type") != "Split" or byte_level.get("type") != "ByteLevel":
        return None
    if byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
        return None
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None


def convert(spec: dict[str, Any]) -> Converted | None:
    """The `tiktoken` encoding of a parsed `tokenizer.json`, or None when it does not have
    the shape described in the module docstring (or `tiktoken` is not installed)."""
    try:
        import tiktoken
    except ImportError:
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None:
        return None
    if model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        return None
    if model.get("end_of_word_suffix"):
        return None
    pattern = pattern_of(spec)
    if pattern is None:
        return None
    added: dict[str, int] = {}
    for token in spec.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return None
        if token.get("normalized") and not token.get("special"):
            return None
        added[str(token["content"])] = int(token["id"])
    decode = _unicode_to_byte()
    ranks: dict[bytes, int] = {}
    for text, token_id in (model.get("vocab") or {}).items():
        if text in added:
            continue
        try:
            ranks[bytes(decode[ch] for ch in text)] = int(token_id)
        except KeyError:  # not a byte-level vocabulary after all
            return None
    if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
        return None
    try:
        encoding = tiktoken.Encoding(
            "kvgate", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
        )
    except Exception:  # a pattern the Rust regex engine does not take, duplicate ranks
        return None

    def encode(text: str) -> list[int]:
        return encoding.encode(text, allowed_special="all")

    if not added:
        encode = encoding.encode_ordinary
    return Converted(encode, pattern, any("\n" in token for token in added))


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, reversed (the vocabulary is written in it)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
