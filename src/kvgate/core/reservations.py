"""Where reservations live: a tiny store interface and its in-process implementation.

A reservation is an amount of KV tokens held on one node under a unique key (one per
admitted ticket). The amount is the part of the request's footprint that the engine's
latest sample cannot reflect yet (see `kvgate.core.policies.base` for the accounting);
the policy lowers it with `update()` as samples catch up and removes it with `release()`.

The interface is deliberately small and amount-based, so that a shared store (Redis hashes
per node with a per-key TTL, for several gateway replicas) can replace the in-process one
without touching the policies. `release()` is idempotent: the second call finds nothing
and returns None, which is what makes "release exactly once" hold even when the I/O shell
calls it from several `finally:` paths.
"""

from __future__ import annotations

from typing import Protocol


class ReservationStore(Protocol):
    """Per-node reservations keyed by ticket."""

    def reserve(self, node_id: str, key: str, tokens: int) -> None:
        """Hold `tokens` on `node_id` under `key` (a new, unique key)."""
        ...

    def update(self, node_id: str, key: str, tokens: int) -> None:
        """Change the amount held under `key`; no-op when `key` is not held."""
        ...

    def release(self, node_id: str, key: str) -> int | None:
        """Drop `key`; return the amount it held, or None when nothing was held."""
        ...

    def reserved(self, node_id: str) -> int:
        """Tokens currently held on `node_id`."""
        ...

    def count(self, node_id: str) -> int:
        """Reservations currently held on `node_id`."""
        ...

    def total_reserved(self) -> int: ...

    def total_count(self) -> int: ...


class InProcessReservationStore:
    """Dict-backed store with O(1) operations and running per-node sums."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        self._sums: dict[str, int] = {}
        self._total = 0
        self._count = 0

    def reserve(self, node_id: str, key: str, tokens: int) -> None:
        if tokens < 0:
            raise ValueError("a reservation cannot be negative")
        held = self._held.setdefault(node_id, {})
        if key in held:
            raise KeyError(f"reservation {key!r} already held on {node_id!r}")
        held[key] = tokens
        self._sums[node_id] = self._sums.get(node_id, 0) + tokens
        self._total += tokens
        self._count += 1

    def update(self, node_id: str, key: str, tokens: int) -> None:
        held = self._held.get(node_id)
        if held is None or key not in held:
            return
        if tokens < 0:
            raise ValueError("a reservation cannot be negative")
        delta = tokens - held[key]
        held[key] = tokens
        self._sums[node_id] += delta
        self._total += delta

    def release(self, node_id: str, key: str) -> int | None:
        held = self._held.get(node_id)
        if held is None or key not in held:
            return None
        tokens = held.pop(key)
        self._sums[node_id] -= tokens
        self._total -= tokens
        self._count -= 1
        if not held:
            del self._held[node_id]
            del self._sums[node_id]
        return tokens

    def reserved(self, node_id: str) -> int:
        return self._sums.get(node_id, 0)

    def count(self, node_id: str) -> int:
        held = self._held.get(node_id)
        return len(held) if held else 0

    def total_reserved(self) -> int:
        return self._total

    def total_count(self) -> int:
        return self._count
