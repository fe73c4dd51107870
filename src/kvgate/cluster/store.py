"""The cluster store's interface: one exchange per sync tick, and a goodbye.

A store holds, for every live replica (a *member*), its heartbeat deadline and its latest
*view* (opaque bytes: what the replica publishes, see `kvgate.cluster.publication`). One call,
`exchange`, is a whole sync tick: it drops the members whose heartbeat expired, beats for
the caller, stores the caller's view and returns every live view with the store's clock.
Doing all of it in one atomic step means one round trip per tick and no reader ever sees
the view of a member it does not count.

Implementations: `RedisStore` (shared by processes and hosts, `kvgate.cluster.redis_store`)
and `MemoryStore` (one process: tests and the simulator, below). Failures surface as
`StoreError`; the caller bounds every call with its own timeout.

`MemoryStore` has the same semantics as Redis, in-process. `exchange_now` is its synchronous
heart (the virtual-time simulator calls it directly and models the latency itself); the
async methods are the `ClusterStore` interface around it. `available = False` makes every
call fail as an unreachable store does: how tests and the simulator model an outage. Time
comes from an injected clock, as in the core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.core.clock import Clock


class StoreError(Exception):
    """The store could not be reached, refused us, or answered something unreadable."""


@dataclass(frozen=True, slots=True)
class Exchange:
    """What one sync tick brings back."""

    store_time: float  # seconds on the store's own clock, when it ran the exchange
    views: Mapping[str, bytes]  # every live member's latest view, the caller's included


class ClusterStore(Protocol):
    async def exchange(self, member: str, view: bytes, ttl_s: float) -> Exchange:
        """Prune expired members, beat for `member` (alive for `ttl_s` more), store its
        `view` and return every live view. Atomic."""
        ...

    async def prepare(self) -> None:
        """Make the next exchange a single round trip: connect (TLS, password, protocol
        handshake) and load what the exchange runs. Called before the first exchange and
        after a failed one, under a longer timeout than an exchange's, so that a
        handshake slower than one tick still completes."""
        ...

    async def leave(self, member: str) -> None:
        """Forget `member` now (a replica that stops), instead of after its ttl."""
        ...

    async def close(self) -> None:
        """Release connections; the store's data stays."""
        ...

    def describe(self) -> str:
        """Where the store is, for logs and /admin/state (never a password)."""
        ...


class MemoryStore:
    """The store in this process (see the module docstring)."""

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
