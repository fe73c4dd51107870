"""The cluster store's interface: one exchange per sync tick, and a goodbye.

A store holds, for every live replica (a *member*), its heartbeat deadline and its latest
*view* (opaque bytes: what the replica publishes, see `kvgate.cluster.envelope`). One call,
`exchange`, is a whole sync tick: it drops the members whose heartbeat expired, beats for
the caller, stores the caller's view and returns every live view with the store's clock.
Doing all of it in one atomic step means one round trip per tick and no reader ever sees
the view of a member it does not count.

Implementations: `RedisStore` (shared by processes and hosts) and `MemoryStore` (one
process: tests and the simulator). Failures surface as `StoreError`; the caller bounds
every call with its own timeout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


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
