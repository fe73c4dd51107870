"""Waiting for a condition with a deadline, for tests and benchmarks that watch servers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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
