"""Retry-After: how long a shed client should wait, from how fast capacity is being freed.

The centre is `excess_tokens / freed_tokens_per_s`: the time the cluster needs, at the rate
it has recently been releasing KV tokens, to free enough to take the request back under its
target. It is clamped to [1 s, max], then spread by +-20% uniform jitter (so that shed
clients do not come back in lock-step) and clamped again, so the value is always within
+-20% of the clamped centre, never below 1 s and never above the maximum.
"""

from __future__ import annotations

import random

MIN_RETRY_AFTER_S = 1.0
#: The longest Retry-After kvgate sends. A predicted wait beyond half a minute is too
#: uncertain to ask a client to sit out (the load changes faster), a client that comes back
#: sooner is judged again at little cost, and the OpenAI SDKs obey a Retry-After only up to
#: 60 s (longer, they fall back to their own short back-off).
MAX_RETRY_AFTER_S = 30.0
JITTER = 0.2


def retry_after_centre(excess_tokens: float, freed_tokens_per_s: float, max_s: float) -> float:
    """The un-jittered delay; `max_s` when nothing is being freed."""
    max_s = max(MIN_RETRY_AFTER_S, max_s)
    if excess_tokens <= 0:
        return MIN_RETRY_AFTER_S
    if freed_tokens_per_s <= 0:
        return max_s
    return min(max_s, max(MIN_RETRY_AFTER_S, excess_tokens / freed_tokens_per_s))


def jittered(centre: float, rng: random.Random, max_s: float) -> float:
    """`centre` times a uniform factor in [0.8, 1.2], kept within [1 s, max_s]."""
    value = centre * rng.uniform(1.0 - JITTER, 1.0 + JITTER)
    return min(max(MIN_RETRY_AFTER_S, max_s), max(MIN_RETRY_AFTER_S, value))


def retry_after(
    excess_tokens: float, freed_tokens_per_s: float, max_s: float, rng: random.Random
) -> float:
    """Jittered Retry-After in seconds (float; the shell rounds up for the header)."""
    return jittered(retry_after_centre(excess_tokens, freed_tokens_per_s, max_s), rng, max_s)
