"""What a request's body is made of, measured once: the `CostBasis` every costing reads.

A body is walked once (`measure`): each prompt becomes a part of exact tokens (token ids
sent as such) and characters still to estimate (text, chat messages with every string in
them, tools); with the number of sequences per prompt (`n`, `best_of`) and the output cap
the body names, that is all a cost is made of besides the model's learned ratio. So a
waiting request is re-costed from its basis alone, without its body, when a better count
arrives (`with_count`) or the ratio moves.

An exact count (`PromptCount`) comes from outside the core: the model's tokenizer or the
engine's own `/tokenize`, run by the shell (kvgate.gateway.tokens). It replaces the
characters of every prompt it counts, and brings the prompt's token ids when it has them.

The walk is cheap on purpose: the prompt's length is the sum of its strings' lengths, found
by walking the already-parsed body; nothing is re-encoded to JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

#: Where a basis's prompt tokens come from: token ids in the body, the model's tokenizer,
#: the engine's `/tokenize`, or (for any characters left) the learned ratio.
Source = Literal["ids", "tokenizer", "engine", "estimate"]

# Template allowance per chat message (role markers, separators), in characters.
MESSAGE_OVERHEAD_CHARS = 16
# A non-text content part (image, audio) counted as this many characters.
MEDIA_PART_CHARS = 4096
# Deepest nesting walked when measuring a body (bounded: bodies are untrusted).
MAX_DEPTH = 32


class CostError(ValueError):
    """The body cannot be costed; `param` names the offending field (OpenAI error style)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class PromptCount:
    """A request's prompts counted as the engine will count them.

    `per_prompt`: each prompt's tokens, in order (one entry for a chat or a single prompt;
    a batched completion has one per prompt). `ids`: the token ids of a single prompt, when
    the count came with them (None for a batch, or for a count made without ids).
    """

    per_prompt: tuple[int, ...]
    ids: tuple[int, ...] | None = None
    source: Source = "tokenizer"


@dataclass(frozen=True, slots=True)
class CostBasis:
    """A request's cost inputs, as measured from its body.

    `parts`: per prompt, (exact tokens, characters still to estimate). `copies`: sequences
    generated per prompt (`n`, `best_of`). `asked`: the output cap per sequence the body
    names (None: none). `context`: the model's context length when the engines list it.
    `implicit_output`: what the engine generates for a body that names no cap, when that is
    a fixed amount (vLLM's completions: 16); None where it generates up to the context.
    `ids`: the single prompt's token ids as the engine will see them, when known.
    """

    model: str
    parts: tuple[tuple[int, int], ...]
    copies: int = 1
    asked: int | None = None
    context: int | None = None
    implicit_output: int | None = None
    ids: tuple[int, ...] | None = None
    source: Source = "estimate"

    @property
    def chars(self) -> int:
        """Characters still to estimate, over every prompt."""
        return sum(c for _, c in self.parts)

    @property
    def exact_tokens(self) -> int:
        """Tokens known exactly, over every prompt (once each, not per copy)."""
        return sum(e for e, _ in self.parts)

    @property
    def exact(self) -> bool:
        """Every prompt is counted exactly."""
        return all(c == 0 for _, c in self.parts)

    def with_count(self, count: PromptCount) -> CostBasis:
        """This basis with `count` in place of its estimated prompts; unchanged when the
        count does not have one entry per prompt."""
        if len(count.per_prompt) != len(self.parts):
            return self
        parts = tuple((tokens, 0) for tokens in count.per_prompt)
        return dataclasses.replace(self, parts=parts, ids=count.ids, source=count.source)


def measure(
    model: str,
    body: dict[str, Any],
    context: int | None = None,
    implicit_output: int | None = None,
) -> CostBasis:
    """The basis of a completion or chat body; raises CostError for one that cannot be
    costed."""
    if not isinstance(body, dict):
        raise CostError("the request body must be a JSON object")
    ids: tuple[int, ...] | None = None
    if "messages" in body:
        parts: tuple[tuple[int, int], ...] = ((0, _message_chars(body)),)
    elif "prompt" in body:
        parts, ids = _prompt_parts(body["prompt"])
    else:
        raise CostError("the request has neither `messages` nor `prompt`", "messages")
    return CostBasis(
        model,
        parts,
        copies=_copies(body),
        asked=_output_cap(body),
        context=context,
        implicit_output=implicit_output,
        ids=ids,
        source="ids" if ids is not None or all(c == 0 for _, c in parts) else "estimate",
    )


def _text_length(value: Any, depth: int = 0) -> int:
    """Sum of the lengths of every string inside a parsed JSON value."""
    if isinstance(value, str):
        return len(value)
    if depth >= MAX_DEPTH:
        return 0
    if isinstance(value, dict):
        return sum(_text_length(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return sum(_text_length(v, depth + 1) for v in value)
    return 0


def _message_chars(body: dict[str, Any]) -> int:
    messages = body["messages"]
    if not isinstance(messages, list):
        raise CostError("`messages` must be an array", "messages")
    chars = 0
    for message in messages:
        if not isinstance(message, dict):
            raise CostError("each message must be an object", "messages")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    chars += MEDIA_PART_CHARS
        for value in message.values():
            chars += len(value) if isinstance(value, str) else _text_length(value)
        chars += MESSAGE_OVERHEAD_CHARS
    for key in ("tools", "functions", "response_format"):
        if key in body:
            chars += _text_length(body[key])
    return chars


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _prompt_parts(value: Any) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...] | None]:
    """Per prompt (exact tokens, characters), and the token ids of a single id prompt."""
    if isinstance(value, str):
        return ((0, len(value)),), None
    if not isinstance(value, list) or not value:
        raise CostError("`prompt` must be a string, an array of strings or of token ids", "prompt")
    if _is_ids(value):
        return ((len(value), 0),), tuple(value)
    parts: list[tuple[int, int]] = []
    for item in value:
        if isinstance(item, str):
            parts.append((0, len(item)))
        elif _is_ids(item):
            parts.append((len(item), 0))
        else:
            raise CostError("`prompt` items must be strings or arrays of token ids", "prompt")
    return tuple(parts), None


def _output_cap(body: dict[str, Any]) -> int | None:
    """The output cap per sequence the body names (None: it names none)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostError(f"`{key}` must be a positive integer", key)
        return value
    return None


def _copies(body: dict[str, Any]) -> int:
    copies = 1
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostError(f"`{key}` must be a positive integer", key)
        copies = max(copies, value)
    return copies
