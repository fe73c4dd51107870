"""Waiting for a condition with a deadline, for tests and benchmarks that watch servers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx

#: Between two looks at the condition: short against the 10-100 ms events the tests wait
#: for, long enough that polling costs the servers under test nothing measurable.
POLL_INTERVAL_S = 0.002


async def eventually(predicate: Callable[[], bool], within: float = 2.0) -> bool:
    """Poll `predicate` every 2 ms for at most `within` seconds; its last value."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_INTERVAL_S)
    return True


async def until_ready(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    """Await `check` every 0.1 s until it answers True (a server's page read over HTTP:
    transport errors and a page not yet complete count as not ready); RuntimeError naming
    `what` after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, TypeError, ValueError):
            if await check():
                return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} was not ready within {within:.0f} s")
