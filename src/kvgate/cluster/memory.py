"""The in-process cluster store: the same semantics as Redis, for tests and the simulator.

`exchange_now` is the synchronous heart (the virtual-time simulator calls it directly and
models the latency itself); the async methods are the `ClusterStore` interface around it.
`available = False` makes every call fail as an unreachable store does: how tests and the
simulator model an outage. Time comes from an injected clock, as in the core.
"""

from __future__ import annotations

from kvgate.cluster.store import Exchange, StoreError
from kvgate.core.clock import Clock


class MemoryStore:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.available = True
        self._deadlines: dict[str, float] = {}
        self._views: dict[str, bytes] = {}

    def exchange_now(self, member: str, view: bytes, ttl_s: float) -> Exchange:
        self._check()
        now = self.clock.now()
        for dead in [m for m, deadline in self._deadlines.items() if deadline <= now]:
            del self._deadlines[dead]
            self._views.pop(dead, None)
        self._deadlines[member] = now + ttl_s
        self._views[member] = view
        return Exchange(now, dict(self._views))

    def leave_now(self, member: str) -> None:
        self._check()
        self._deadlines.pop(member, None)
        self._views.pop(member, None)

    def wipe(self) -> None:
        """Lose everything, as a store restarted empty does."""
        self._deadlines.clear()
        self._views.clear()

    async def exchange(self, member: str, view: bytes, ttl_s: float) -> Exchange:
        return self.exchange_now(member, view, ttl_s)

    async def prepare(self) -> None:
        self._check()

    async def leave(self, member: str) -> None:
        self.leave_now(member)

    async def close(self) -> None:
        return None

    def describe(self) -> str:
        return "memory"

    def _check(self) -> None:
        if not self.available:
            raise StoreError("store unavailable")
