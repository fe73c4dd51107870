"""One model's tokenizer, applied as the engine applies it: the prompt's ids, exactly.

- A completion's prompt is encoded with the special tokens the engine adds (vLLM tokenizes
  it with `add_special_tokens`: e.g. a leading `<s>`), read from the `tokenizer.json`'s
  post-processor and the `add_bos_token`/`add_eos_token` of `tokenizer_config.json` where
  it states them (as `transformers` applies them).
- A chat is rendered by the model's chat template (kvgate.gateway.tokens.template) and the
  text encoded without added special tokens (the template writes its own), as vLLM does;
  a chat the template cannot promise to render as the engine does is not counted here.

The ids come from the reference `tokenizers` tokenizer or, where it converts and agrees on
a validation corpus at load (`validate`), from its `tiktoken` conversion
(kvgate.gateway.tokens.bpe); either way through a cache of repeated segments
(kvgate.gateway.tokens.segments), whose cuts are validated the same way.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

from kvgate.gateway.tokens.bpe import convert
from kvgate.gateway.tokens.segments import DEFAULT_MAX_TOKENS, SegmentCache
from kvgate.gateway.tokens.template import ChatTemplate

log = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]

#: Texts every fast path must encode exactly as the reference does before it is used.
_SAMPLES = (
    "Hello, world! It's a test: don't panic; we'll see.\n\nNew paragraph.",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "  leading spaces\ntrailing spaces   \n\n\n  \t mixed\r\nwindows\r\nlines",
    "numbers 1234567890 3.14159 -42 1e10 0x1F 12,345.67",
    "unicode: café naïve Ωmega 日本語のテキスト 한국어 emoji 🙂👍🏽 ‘quotes’ “double”",
    "punctuation!!! ??? ... --- ___ *** ### @@@ $$$ %%% ^^^ &&& ((())) [[]] {{}}",
    '{"json": [1, 2, {"k": "v"}], "s": "a\\nb"}\n<tag attr="x">text</tag>',
    "a\nb\n c\n\nd \ne\n\n\nf\n",
)
_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    " \n\t\r!?.,;:'\"-_()[]{}<>/\\|@#$%^&*+=~`éüßΩ日本😀"
)


class ModelTokenizer:
    """A model's tokenizer for counting prompts; see the module docstring."""

    def __init__(
        self,
        reference: Any,
        spec: dict[str, Any],
        template: ChatTemplate | None = None,
        special: tuple[list[int], list[int]] = ([], []),
        max_cached_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self.reference = reference
        self.template = template
        self.prefix, self.suffix = special
        converted = convert(spec)

        def plain(text: str) -> list[int]:
            return list(reference.encode(text, add_special_tokens=False).ids)

        encode: Encode = plain
        self.fast = False
        if converted is not None and _agrees(converted.encode, plain, _corpus(spec)):
            encode, self.fast = converted.encode, True
        split = converted is not None and converted.splits_at_lines
        self.segments = SegmentCache(encode, split=split, max_tokens=max_cached_tokens)
        if split and not _agrees(self.segments.encode, plain, _corpus(spec)):
            self.segments = SegmentCache(encode, split=False, max_tokens=max_cached_tokens)
        self.segments.clear()

    @property
    def splits(self) -> bool:
        return self.segments.split

    def prompt_ids(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens the engine adds."""
        ids = self.segments.encode(text)
        if self.prefix or self.suffix:
            return [*self.prefix, *ids, *self.suffix]
        return ids

    def chat_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """A chat's ids as the engine will see them, or None when they cannot be promised."""
        if self.template is None:
            return None
        text = self.template.render(body)
        if text is None:
            return None
        return self.segments.encode(text)

    def describe(self) -> str:
        way = "tiktoken" if self.fast else "tokenizers"
        cut = "cut at lines" if self.splits else "whole texts"
        chat = "chat template" if self.template is not None else "no chat template"
        return f"{way}, cache of {cut}, {chat}"


def special_ids(reference: Any, config: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The ids the engine adds around a completion's prompt: what the post-processor adds,
    with `add_bos_token`/`add_eos_token` applied where `tokenizer_config.json` states them."""
    probe = "x"
    plain = list(reference.encode(probe, add_special_tokens=False).ids)
    full = list(reference.encode(probe, add_special_tokens=True).ids)
    at = _find(full, plain)
    prefix, suffix = (full[:at], full[at + len(plain) :]) if at >= 0 else ([], [])
    stated_sides = (("add_bos_token", "bos_token", prefix), ("add_eos_token", "eos_token", suffix))
    for flag, name, side in stated_sides:
        stated = config.get(flag)
        token = _token_text(config.get(name))
        token_id = reference.token_to_id(token) if token is not None else None
        if not isinstance(stated, bool) or token_id is None:
            continue
        if stated and token_id not in side:
            side.insert(0 if side is prefix else len(side), token_id)
        elif not stated and token_id in side:
            side.remove(token_id)
    return prefix, suffix


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _find(whole: list[int], part: list[int]) -> int:
    for at in range(len(whole) - len(part) + 1):
        if whole[at : at + len(part)] == part:
            return at
    return -1


def _corpus(spec: dict[str, Any]) -> list[str]:
    """The validation texts: fixed samples, random mixes of everything the pre-tokenizer
    distinguishes (seeded: the same at every start), and each added token inside text."""
    rng = random.Random(23)
    texts = list(_SAMPLES)
    for _ in range(64):
        texts.append("".join(rng.choice(_ALPHABET) for _ in range(rng.randint(20, 200))))
    for token in (spec.get("added_tokens") or [])[:64]:
        content = str(token.get("content", ""))
        texts.append(f"before {content} after\n{content}\nx{content}y")
    return texts


def _agrees(candidate: Encode, reference: Encode, texts: list[str]) -> bool:
    try:
        return all(candidate(text) == reference(text) for text in texts)
    except Exception:
        log.debug("a fast tokenizer path failed its validation", exc_info=True)
        return False
