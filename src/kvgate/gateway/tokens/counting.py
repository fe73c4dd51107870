"""Counting a request's prompt as the engine will, the best way that works, in this order:

1. token ids in the body: the core's basis counts them itself;
2. the model's tokenizer (`admission.tokenizers`), when it can promise the engine's ids
   (kvgate.gateway.tokens.model): microseconds, no round trip;
3. the engine's own count, `/tokenize` on one of the model's vLLM candidates
   (kvgate.gateway.tokens.engine), waited for `WAIT_S` at most: an answer that comes later
   re-costs the request if it is still waiting (kvgate.gateway.relay.recost);
4. the estimate, from the model's learned characters per token (kvgate.core.cost).

Every count the model's tokenizer made is checked against the `usage.prompt_tokens` the
engine reports for the request (`check`). A tokenizer that disagrees `STRIKES` times in a
row for a model's chats (or its completions' prompts) is not used for them again: the
count goes to the engine or the estimate, and an error says so once. An under-count is the
one error admission cannot absorb, so a count that cannot be trusted is not used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvgate.core.cost import CostBasis, PromptCount
from kvgate.gateway.tokens.engine import EngineCounter
from kvgate.gateway.tokens.model import ModelTokenizer

log = logging.getLogger(__name__)

#: How long a request waits for the engine's count before it is costed by the estimate.
WAIT_S = 0.1
#: Disagreements in a row with the engine after which a tokenizer is not used.
STRIKES = 3

Spawn = Callable[[Awaitable[Any]], "asyncio.Task[Any]"]
#: The engine's count on its way: a task whose result is the count, or None.
Pending = "asyncio.Task[PromptCount | None]"


class PromptCounter:
    """The shell's counts of prompts for the core's estimator; see the module docstring."""

    def __init__(
        self,
        tokenizers: Mapping[str, ModelTokenizer],
        engines: EngineCounter | None = None,
        spawn: Spawn | None = None,
        wait_s: float = WAIT_S,
    ) -> None:
        self.tokenizers = dict(tokenizers)
        self.engines = engines
        self.spawn = spawn
        self.wait_s = wait_s
        self._strikes: dict[tuple[str, bool], int] = {}
        self._distrusted: set[tuple[str, bool]] = set()

    def local(self, model: str, body: Mapping[str, Any], chat: bool) -> PromptCount | None:
        """The model's tokenizer's count, or None when it has none or cannot promise one."""
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None or (model, chat) in self._distrusted:
            return None
        if chat:
            ids = tokenizer.chat_ids(body)
            return None if ids is None else PromptCount((len(ids),), tuple(ids))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tokenizer.prompt_ids(prompt)
            return PromptCount((len(ids),), tuple(ids))
        if not isinstance(prompt, list):
            return None
        counts = []
        for item in prompt:  # a batch (token-id items count themselves)
            if isinstance(item, str):
                counts.append(len(tokenizer.prompt_ids(item)))
            elif isinstance(item, list):
                counts.append(len(item))
            else:
                return None
        return PromptCount(tuple(counts))

    async def remote(
        self, model: str, body: Mapping[str, Any], candidates: tuple[str, ...]
    ) -> tuple[PromptCount | None, asyncio.Task[PromptCount | None] | None]:
        """The engine's count if it comes within `wait_s`: (count, None); else (None, the
        task still on its way, or None when no engine may be asked)."""
        engines = self.engines
        if engines is None or self.spawn is None:
            return None, None
        backend = engines.backend_for(candidates)
        if backend is None:
            return None, None
        payload = engines.request_body(model, body)
        if payload is None:
            return None, None
        task: asyncio.Task[PromptCount | None] = self.spawn(engines.ask(backend, payload))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.wait_s), None
        except TimeoutError:
            return None, task

    def check(self, basis: CostBasis, chat: bool, prompt_tokens: int) -> None:
        """The engine counted `prompt_tokens` for a request costed on `basis`: a count of
        the model's tokenizer that disagrees is a strike against it (see the module
        docstring)."""
        if basis.source != "tokenizer":
            return
        key = (basis.model, chat)
        if prompt_tokens == basis.exact_tokens:
            self._strikes.pop(key, None)
            return
        strikes = self._strikes.get(key, 0) + 1
        self._strikes[key] = strikes
        if strikes >= STRIKES and key not in self._distrusted:
            self._distrusted.add(key)
            kind = "chats" if chat else "prompts"
            log.error(
                "the tokenizer of %s counted %d prompt tokens where the engine counted %d"
                " (%d times in a row): its %s are counted by the engine or estimated from"
                " now on; check admission.tokenizers",
                basis.model,
                basis.exact_tokens,
                prompt_tokens,
                strikes,
                kind,
            )

    def snapshot(self) -> dict[str, Any]:
        return {
            "tokenizers": {m: t.describe() for m, t in self.tokenizers.items()},
            "distrusted": sorted(f"{m} {'chat' if c else 'prompt'}" for m, c in self._distrusted),
            "engine": None if self.engines is None else self.engines.snapshot(),
        }
