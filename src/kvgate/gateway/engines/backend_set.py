"""Changing a running gateway's backends: what changed, and what a reload may not change.

Platform teams add and drain engines while the gateway serves (a new node joins, one goes
for maintenance), and the next step is discovery in Kubernetes. A restart for each would
cut every stream in flight. `diff_backends` compares the configured backends with a new
list by node id; `Gateway.set_backends` (kvgate.gateway.app) applies the difference:
added nodes are scraped and routed to at once, removed ones get no new request while the
requests already on them run to their end. A node whose URL, metrics page, dialect, key or
KV capacity changed is replaced (removed and added under the same id).

A reload re-reads the whole configuration, but only `backends` and `auth` (API keys,
tenant limits; see `Security.update`) take effect while running: the other sections are
built into long-lived objects (the listening socket, the policy, the limits), so
`restart_needed` names those that differ, to be logged and shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.adapters.backend import Backend
from kvgate.config import KvgateConfig


@dataclass(frozen=True, slots=True)
class BackendChange:
    """The difference between two backend lists, by node id."""

    added: tuple[Backend, ...] = ()
    removed: tuple[Backend, ...] = ()
    #: (old, new) pairs: the same node id with another address, page, dialect, key or size.
    replaced: tuple[tuple[Backend, Backend], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.replaced)

    def as_dict(self) -> dict[str, list[str]]:
        return {
            "added": [b.node_id for b in self.added],
            "removed": [b.node_id for b in self.removed],
            "replaced": [new.node_id for _, new in self.replaced],
        }

    def describe(self) -> str:
        """One line for the log: 'added a, b; removed c' (or 'no change')."""
        parts = [f"{verb} {', '.join(ids)}" for verb, ids in self.as_dict().items() if ids]
        return "; ".join(parts) or "no change"


def diff_backends(current: Sequence[Backend], new: Sequence[Backend]) -> BackendChange:
    """What turns `current` into `new` (both with unique node ids)."""
    old_by_id = {b.node_id: b for b in current}
    new_ids = {b.node_id for b in new}
    added = tuple(b for b in new if b.node_id not in old_by_id)
    replaced = tuple(
        (old_by_id[b.node_id], b)
        for b in new
        if b.node_id in old_by_id and old_by_id[b.node_id] != b
    )
    removed = tuple(b for b in current if b.node_id not in new_ids)
    return BackendChange(added=added, removed=removed, replaced=replaced)


def restart_needed(running: KvgateConfig, loaded: KvgateConfig) -> list[str]:
    """Top-level sections other than `backends` that differ: they apply at the next start."""
    before: dict[str, Any] = running.model_dump(exclude={"backends"})
    after: dict[str, Any] = loaded.model_dump(exclude={"backends"})
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
