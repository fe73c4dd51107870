"""KV cost of a request: prompt tokens (estimated or exact) plus every token it may generate.

Public API::

    estimator = CostEstimator(settings, tokenizers={model: tokenizer})
    cost = estimator.estimate(model, body, context)  # -> RequestCost (raises CostError)
    estimator.learn(model, cost.prompt_tokens, usage["prompt_tokens"])

Prompt tokens come from a per-model chars-per-token ratio, which learns online from the
`usage.prompt_tokens` the engine reports (EWMA, clamped to
[`chars_per_token_min`, `chars_per_token_max`]), and are multiplied by
`prompt_safety_factor`, because under-estimating a prompt is the one error the
reservation accounting cannot absorb before the request's first token. A model given a
tokenizer gets exact counts for plain prompts (chat messages are encoded as their
concatenated text plus a small per-message allowance for the template). Token-id prompts
are counted exactly. The estimator is handed its tokenizers already loaded: reading a
`tokenizer.json` is file I/O, which the shell does once at startup
(kvgate.gateway.relay.tokenizers), never the core on a request's path.

The estimate is cheap on purpose: the prompt's length is the sum of its strings' lengths,
found by walking the already-parsed body; nothing is re-encoded to JSON.

The output side is `max_completion_tokens` (chat), else `max_tokens`, multiplied by the
number of sequences the request asks for (`n`, `best_of`, and the number of prompts in a
batched completion), since each sequence grows its own KV blocks. With the model's context
length (`context`, when the engines list it) no sequence holds more than it: the output is
cut to the rest of the context after the prompt's floor, and a request that names no cap
gets that rest as its cap (`RequestCost.open_output`): the most an engine generates for it
(vLLM's chat completions go that far; its completions stop at OpenAI's default of 16).
How long it really runs is planned by the output lengths learned per model
(`kvgate.core.lengths`). Without a context, a request that names no cap is costed at
`default_max_tokens`, which the shell then sends upstream as its cap.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.core.request import RequestCost
from kvgate.core.settings import AdmissionSettings

# Characters per token of typical English text: what a prompt's length is judged by against a
# context limit before the model's own ratio has been learned.
TYPICAL_CHARS_PER_TOKEN = 4.0
# Template allowance per chat message (role markers, separators), in characters.
MESSAGE_OVERHEAD_CHARS = 16
# Exact-tokenizer template allowance per chat message, in tokens.
MESSAGE_OVERHEAD_TOKENS = 4
# A non-text content part (image, audio) counted as this many characters.
MEDIA_PART_CHARS = 4096
# Weight of one observation in the learned ratio.
LEARN_ALPHA = 0.1
# Deepest nesting walked when measuring a body (bounded: bodies are untrusted).
MAX_DEPTH = 32
# Estimates remembered for learning (enough for the requests in flight at once).
MEMORY = 4096


class CostError(ValueError):
    """The body cannot be costed; `param` names the offending field (OpenAI error style)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Tokenizer(Protocol):
    """What we need of a `tokenizers.Tokenizer`: `encode(text).ids`."""

    def encode(self, text: str) -> Any: ...


@dataclass(slots=True)
class _Prompt:
    """What was measured: characters to convert, tokens already exact, segments."""

    chars: int = 0
    exact_tokens: int = 0
    texts: list[str] | None = None  # kept only when a tokenizer will count them
    sequences: int = 1  # prompts in a batched completion
    messages: int = 0


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


class CostEstimator:
    """Per-model prompt estimation that learns; see the module docstring."""

    def __init__(
        self,
        settings: AdmissionSettings,
        *,
        tokenizers: Mapping[str, Tokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self.tuning = settings.tuning
        self._ratios: dict[str, float] = {}
        self._memory: OrderedDict[tuple[str, int], tuple[int, int]] = OrderedDict()
        self._tokenizers: dict[str, Tokenizer] = dict(tokenizers or {})

    # --- public API -----------------------------------------------------------------------

    def estimate(self, model: str, body: dict[str, Any], context: int | None = None) -> RequestCost:
        """The request's cost, within the model's `context` length when it is known;
        raises CostError for a body that cannot be costed."""
        if not isinstance(body, dict):
            raise CostError("the request body must be a JSON object")
        prompt = self._measure(body)
        per_prompt = self._per_prompt(body)
        exact, chars, approx = self._prompt_tokens(model, prompt)
        # Each of the `n` sequences may hold its own copy of the prompt (no prefix cache).
        tokens = (exact + approx) * per_prompt
        floor = tokens
        if chars > 0:
            self._remember(model, tokens, chars, exact)
            ratio = max(self.ratio(model), TYPICAL_CHARS_PER_TOKEN)
            floor = (exact + int(chars / ratio)) * per_prompt
        sequences = per_prompt * prompt.sequences
        asked = self._output_tokens(body)
        if context is None:
            output = (self.settings.default_max_tokens if asked is None else asked) * sequences
        else:
            # The engine stops each sequence at the context: what they may generate is at
            # most the context less their prompts, which hold at least the floor.
            room = max(0, context * sequences - floor)
            output = room if asked is None else min(asked * sequences, room)
        return RequestCost(tokens, output, floor, open_output=asked is None)

    def longest_prompt(self, model: str, body: dict[str, Any]) -> tuple[int, bool]:
        """The tokens of the body's longest prompt, and whether that count is exact.

        What an engine compares with its context limit: each prompt of a batch alone (and
        `n` copies of one prompt are one prompt). Token ids are exact; text is counted by
        the model's tokenizer if it has one (exact, but for the allowance a chat template
        adds per message), else converted at its learned ratio *without*
        `prompt_safety_factor` (and, before the ratio is learned, at the typical 4 characters
        per token rather than the estimator's cautious start): both keep reservations on the
        safe side, and must not make a prompt look longer than it is to a check that refuses
        it for its length.
        Raises CostError like `estimate`.
        """
        prompt = body.get("prompt") if "messages" not in body else None
        if isinstance(prompt, list) and prompt and not all(isinstance(v, int) for v in prompt):
            parts = [self._measure_prompt(item) if item else _Prompt() for item in prompt]
        else:
            parts = [self._measure(body)]
        longest, exact = 0, True
        # Until the engines have taught it the model's ratio, the typical one: the estimator's
        # starting ratio leans towards longer prompts, the safe way for admission only.
        ratio = self._ratios.get(model, TYPICAL_CHARS_PER_TOKEN)
        for part in parts:
            counted, chars, approx = self._prompt_tokens(model, part, factor=1.0, ratio=ratio)
            if counted + approx > longest:
                longest, exact = counted + approx, chars == 0 and not part.messages
        return longest, exact

    def learn(self, model: str, estimated_prompt: int, actual_prompt_tokens: int) -> None:
        """Move the model's chars-per-token ratio towards what the engine actually counted.

        `estimated_prompt` is the `prompt_tokens` of a cost this estimator produced; the
        estimator remembers (for its last `MEMORY` estimates) how many characters and exact
        tokens made it, so that the ratio learns from the characters only, once per prompt
        (engines count a prompt once in `usage` even with `n` > 1). Estimates it does not
        remember, exact ones (token ids, a configured tokenizer) and non-positive counts
        teach nothing.
        """
        if actual_prompt_tokens <= 0 or estimated_prompt <= 0 or self.tokenizer(model):
            return
        made = self._memory.get((model, estimated_prompt))
        if made is None:
            return
        chars, exact = made
        approx_actual = actual_prompt_tokens - exact
        if approx_actual <= 0:
            return
        ratio = self.ratio(model)
        observed = chars / approx_actual
        updated = ratio + LEARN_ALPHA * (observed - ratio)
        s = self.settings
        self._ratios[model] = min(
            s.tuning.chars_per_token_max, max(s.tuning.chars_per_token_min, updated)
        )

    def _remember(self, model: str, estimated: int, chars: int, exact: int) -> None:
        memory = self._memory
        key = (model, estimated)
        if key in memory:
            memory.move_to_end(key)
        memory[key] = (chars, exact)
        if len(memory) > MEMORY:
            memory.popitem(last=False)

    def ratio(self, model: str) -> float:
        """The current chars-per-token ratio for `model`."""
        return self._ratios.get(model, self.tuning.chars_per_token)

    def tokenizer(self, model: str) -> Tokenizer | None:
        """The tokenizer `model` was given; None when it has none."""
        return self._tokenizers.get(model)

    # --- measuring --------------------------------------------------------------------------

    def _measure(self, body: dict[str, Any]) -> _Prompt:
        if "messages" in body:
            return self._measure_messages(body)
        if "prompt" in body:
            return self._measure_prompt(body["prompt"])
        raise CostError("the request has neither `messages` nor `prompt`", "messages")

    def _measure_messages(self, body: dict[str, Any]) -> _Prompt:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise CostError("`messages` must be an array", "messages")
        prompt = _Prompt(texts=[], messages=len(messages))
        assert prompt.texts is not None
        for message in messages:
            if not isinstance(message, dict):
                raise CostError("each message must be an object", "messages")
            content = message.get("content")
            if isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and part.get("type") not in (None, "text"):
                        prompt.chars += MEDIA_PART_CHARS
            for key, value in message.items():
                if key == "content" and isinstance(value, str):
                    prompt.texts.append(value)
                    prompt.chars += len(value)
                else:
                    prompt.chars += _text_length(value)
            prompt.chars += MESSAGE_OVERHEAD_CHARS
        for key in ("tools", "functions", "response_format"):
            if key in body:
                prompt.chars += _text_length(body[key])
        return prompt

    def _measure_prompt(self, value: Any) -> _Prompt:
        if isinstance(value, str):
            return _Prompt(chars=len(value), texts=[value])
        if not isinstance(value, list) or not value:
            raise CostError(
                "`prompt` must be a string, an array of strings or of token ids", "prompt"
            )
        if all(isinstance(v, int) for v in value):
            return _Prompt(exact_tokens=len(value))
        prompt = _Prompt(texts=[], sequences=len(value))
        assert prompt.texts is not None
        for item in value:
            if isinstance(item, str):
                prompt.chars += len(item)
                prompt.texts.append(item)
            elif isinstance(item, list) and all(isinstance(v, int) for v in item):
                prompt.exact_tokens += len(item)
            else:
                raise CostError("`prompt` items must be strings or arrays of token ids", "prompt")
        return prompt

    def _prompt_tokens(
        self,
        model: str,
        prompt: _Prompt,
        factor: float | None = None,
        ratio: float | None = None,
    ) -> tuple[int, int, int]:
        """(exact tokens, characters left to estimate, their estimated tokens), the estimate
        at `ratio` characters per token (default: the model's) multiplied by `factor`
        (default: `prompt_safety_factor`)."""
        chars = prompt.chars
        exact = prompt.exact_tokens
        tokenizer = self.tokenizer(model) if chars else None
        if tokenizer is not None and prompt.texts is not None:
            for text in prompt.texts:
                exact += len(tokenizer.encode(text).ids)
                chars -= len(text)
            exact += MESSAGE_OVERHEAD_TOKENS * prompt.messages
            chars -= MESSAGE_OVERHEAD_CHARS * prompt.messages
        if chars <= 0:
            return exact, 0, 0
        if factor is None:
            factor = self.tuning.prompt_safety_factor
        approx = math.ceil(chars / (ratio or self.ratio(model)) * factor)
        return exact, chars, approx

    def _output_tokens(self, body: dict[str, Any]) -> int | None:
        """The output cap per sequence the body names (None: it names none)."""
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostError(f"`{key}` must be a positive integer", key)
            return value
        return None

    def _per_prompt(self, body: dict[str, Any]) -> int:
        per_prompt = 1
        for key in ("n", "best_of"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostError(f"`{key}` must be a positive integer", key)
            per_prompt = max(per_prompt, value)
        return per_prompt
