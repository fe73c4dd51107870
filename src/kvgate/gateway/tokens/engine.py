"""The engine's own count of a prompt: vLLM's `POST /tokenize`, asked where no tokenizer is.

vLLM's API server tokenizes a completion's prompt (`{"model", "prompt"}`) or renders and
tokenizes a chat (`{"model", "messages", ...}` with the chat's template options and tools)
exactly as it will for the request itself, and answers `{"count", "max_model_len",
"tokens"}`. `EngineCounter.ask` sends that to one of the model's vLLM-dialect candidates,
through the relay's keep-alive pool (a few tens of microseconds of kvgate's CPU), and
turns the answer into a `PromptCount` with the prompt's ids.

What it learns per backend: an engine that answers 404, 405 or 501 has no such endpoint
(another dialect behind a vLLM-looking URL, an older server): it is not asked again for
`MISSING_FOR_S`. One that fails otherwise (refused, reset, an error status, a malformed
answer) is skipped for `FAILED_FOR_S`. Each call is bounded by `LATE_LIMIT_S` in all; the
caller waits for it only `wait_s` (kvgate.gateway.tokens.counting) and takes a later answer
as a re-count.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kvgate.adapters.backend import Backend
from kvgate.core.cost import PromptCount
from kvgate.gateway.http.h1client import H1Response
from kvgate.gateway.relay.upstream import UpstreamPool, close_quietly

log = logging.getLogger(__name__)

#: The dialects whose engines serve `/tokenize` as vLLM does.
DIALECTS = frozenset({"vllm"})
#: An engine without the endpoint is not asked again for this long.
MISSING_FOR_S = 600.0
#: An engine whose `/tokenize` failed otherwise is skipped for this long.
FAILED_FOR_S = 5.0
#: The longest a count may take in all (a late answer is still a re-count until then).
LATE_LIMIT_S = 5.0
#: The chat request fields that change what vLLM renders, sent along with the messages.
CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
)
_HEADERS = [(b"content-type", b"application/json"), (b"accept", b"application/json")]


class EngineCounter:
    """Asks the engines for their count of a prompt; see the module docstring."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self._skip_until: dict[str, float] = {}  # node id -> monotonic time
        self._turn = itertools.count()
        self.asked = 0
        self.answered = 0
        self.failed = 0

    def backend_for(self, candidates: tuple[str, ...]) -> Backend | None:
        """A candidate that may answer, in turns; None when none may."""
        backends = self.pool.backends
        now = time.monotonic()
        able = [
            b
            for node in candidates
            if (b := backends.get(node)) is not None
            and b.engine in DIALECTS
            and self._skip_until.get(node, 0.0) <= now
        ]
        if not able:
            return None
        return able[next(self._turn) % len(able)]

    def request_body(self, model: str, body: Mapping[str, Any]) -> bytes | None:
        """The `/tokenize` body for a completion or chat body; None when it cannot be
        asked (a batch of prompts, token ids, anything but one string or messages)."""
        messages = body.get("messages")
        if messages is not None:
            ask: dict[str, Any] = {"model": model, "messages": messages}
            for key in CHAT_FIELDS:
                if body.get(key) is not None:
                    ask[key] = body[key]
            return orjson.dumps(ask)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        return orjson.dumps({"model": model, "prompt": prompt})

    async def ask(self, backend: Backend, payload: bytes) -> PromptCount | None:
        """The engine's count, or None when it did not give one within `LATE_LIMIT_S`."""
        self.asked += 1
        node = backend.node_id
        response: H1Response | None = None
        clean = False
        try:
            async with asyncio.timeout(LATE_LIMIT_S):
                response = await self.pool.open(backend, "POST", "/tokenize", _HEADERS, payload)
                data = await response.read()
            clean = True
        except Exception as exc:  # any fault (refused, reset, timeout): no count, no crash
            self._skip(node, FAILED_FOR_S, f"failed: {exc!r}")
            return None
        finally:
            if clean and response is not None:
                response.release()
            else:
                close_quietly(response)
        if response.status in (404, 405, 501):
            self._skip(node, MISSING_FOR_S, f"has no /tokenize ({response.status})")
            return None
        count = _parse(data) if response.status == 200 else None
        if count is None:
            self._skip(node, FAILED_FOR_S, f"answered {response.status} without a count")
            return None
        self.answered += 1
        return count

    def _skip(self, node: str, for_s: float, why: str) -> None:
        self.failed += 1
        if self._skip_until.get(node, 0.0) <= time.monotonic():
            log.info("token counts: %s %s; not asked for %.0f s", node, why, for_s)
        self._skip_until[node] = time.monotonic() + for_s

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "asked": self.asked,
            "answered": self.answered,
            "failed": self.failed,
            "skipped": sorted(n for n, t in self._skip_until.items() if t > now),
        }


def _parse(data: bytes) -> PromptCount | None:
    """The count in a `/tokenize` answer; None for anything but a list of integer ids."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        return None
    try:  # a sum is an int only over ints: a type check of each id at a tenth of the CPU
        if type(sum(tokens)) is not int:
            return None
    except TypeError:
        return None
    count = answer.get("count")
    if count is not None and count != len(tokens):
        return None
    return PromptCount((len(tokens),), tuple(tokens), "engine")
