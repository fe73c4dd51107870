"""One replica's view: what it tells the others every sync, typed, and its JSON form.

A replica builds its `PeerView` (`kvgate.core.replicas.exchange`), the shell publishes its
JSON form through the store (`kvgate.cluster.sync`) or the simulator hands it over as is
(`kvgate.sim.virtual`), and every other replica folds it in (`kvgate.core.replicas.peers`).
The JSON form, the wire format, is written and read here and nowhere else:

    {"replica": "gw-1",
     "nodes": {node: [[unreflected, held, remaining, age_s], ...]},  # its live requests
     "claims": {node: tokens},                          # its claims on each node's slack
     "prefixes": {node: [hash, ...]},                   # marks of the prefixes held there
     "queue": {"waiting_tokens": .., "head_tokens": .., "head_age_s": ..,
               "arrival_tokens_per_s": ..},
     "tenants": {tenant: [tokens, requests]},           # what it holds per tenant
     "tenant_queue": {tenant: [requests, tokens, head_tokens, head_age_s]},
     "tenant_claims": {tenant: [tokens or null, requests or null]},
     "service": {tenant: tokens served},                # its fairness counters
     "budgets": {"members": [replica, ...],             # whose consumption `seen` sums
                 "buckets": {tenant: {window: [consumed, reserved, claim, level, seen]}}},
     "view_age_s": seconds}

`view_age_s` is not published: the receiver sets it (`PeerView.age_s`) to how long ago the
view was published, so that ages of waiting heads compare at one instant. Reading is
tolerant: a field that is missing or of the wrong type reads as empty, and an entry that is
malformed is skipped, so a view from another version of kvgate costs at most what it says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvgate.core.budgets.bucket import BucketEntry, BudgetView

_NUM = frozenset((int, float))  # exact types: JSON numbers as orjson reads them (no bool)
_new_tuple = tuple.__new__


class PeerHold(NamedTuple):
    """One live request of a replica on one node."""

    unreflected: float  # tokens the shared sample cannot contain yet
    held: float  # tokens it holds now
    remaining: float  # steps it still has to run
    age_s: float  # seconds since it was sent to the engine


class QueueDemand(NamedTuple):
    """A replica's queue: the tokens waiting, its head's need and age, and its arrivals."""

    waiting_tokens: float = 0.0
    head_tokens: float = 0.0
    head_age_s: float = 0.0
    arrival_tokens_per_s: float = 0.0


class TenantDemand(NamedTuple):
    """A replica's waiters of one limited tenant."""

    requests: float
    tokens: float
    head_tokens: float
    head_age_s: float


@dataclass(frozen=True, slots=True)
class PeerView:
    """What one replica tells the others (see the module docstring for each field)."""

    replica: str
    nodes: Mapping[str, tuple[PeerHold, ...]] = field(default_factory=dict)
    claims: Mapping[str, float] = field(default_factory=dict)
    # Per node, hashes marking the prompt prefixes its requests hold (`HeldBlocks.marks`).
    prefixes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    queue: QueueDemand = field(default_factory=QueueDemand)
    tenants: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    tenant_queue: Mapping[str, TenantDemand] = field(default_factory=dict)
    tenant_claims: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)
    service: Mapping[str, float] = field(default_factory=dict)
    budgets: BudgetView = field(default_factory=BudgetView)
    age_s: float = 0.0  # set by the receiver: how long ago it was published

    def to_json(self) -> dict[str, Any]:
        """The JSON form (`view_age_s` only once a receiver has set it)."""
        out: dict[str, Any] = {
            "replica": self.replica,
            "nodes": {n: [list(h) for h in holds] for n, holds in self.nodes.items()},
            "claims": dict(self.claims),
            "queue": self.queue._asdict(),
            "tenants": {t: list(u) for t, u in self.tenants.items()},
            "tenant_queue": {t: list(d) for t, d in self.tenant_queue.items()},
            "tenant_claims": {t: list(c) for t, c in self.tenant_claims.items()},
            "service": dict(self.service),
        }
        if self.prefixes:
            out["prefixes"] = {n: list(marks) for n, marks in self.prefixes.items()}
        if self.budgets.buckets:
            out["budgets"] = {
                "members": list(self.budgets.members),
                "buckets": {
                    t: {w: _published(e) for w, e in entries.items()}
                    for t, entries in self.budgets.buckets.items()
                },
            }
        if self.age_s:
            out["view_age_s"] = self.age_s
        return out

    @classmethod
    def from_json(cls, data: Any) -> PeerView:
        """The view in `data` (a decoded JSON object), whatever of it can be read."""
        if not isinstance(data, Mapping):
            data = {}
        queue = _section(data, "queue")
        nodes = {
            str(n): _holds(entries)
            for n, entries in _section(data, "nodes").items()
            if isinstance(entries, list)
        }
        tenants = {
            str(t): (int(u[0]), int(u[1]))
            for t, e in _section(data, "tenants").items()
            if (u := _numbers(e, 2))
        }
        tenant_queue = {
            str(t): TenantDemand(*d)
            for t, e in _section(data, "tenant_queue").items()
            if (d := _numbers(e, 4))
        }
        tenant_claims = {
            str(t): (c[0], c[1])
            for t, e in _section(data, "tenant_claims").items()
            if (c := _numbers(e, 2, optional=True))
        }
        return cls(
            replica=str(data.get("replica", "")),
            nodes=nodes,
            claims=_floats(_section(data, "claims")),
            prefixes={
                str(n): tuple(h for h in marks if type(h) is int)
                for n, marks in _section(data, "prefixes").items()
                if isinstance(marks, list)
            },
            queue=QueueDemand(*(_number(queue.get(f)) for f in QueueDemand._fields)),
            tenants=tenants,
            tenant_queue=tenant_queue,
            tenant_claims=tenant_claims,
            service=_floats(_section(data, "service")),
            budgets=_budgets(_section(data, "budgets")),
            age_s=_number(data.get("view_age_s")),
        )


def _published(entry: BucketEntry) -> list[float]:
    """A bucket's entry to a tenth of a token, each figure rounded the safe way for the
    readers: what it used, holds and claims up, its level and what that counts down."""
    consumed, reserved, claim, level, seen = entry
    return [_up(consumed), _up(reserved), _up(claim), _down(level), _down(seen)]


def _up(x: float) -> float:
    return math.ceil(x * 10) / 10


def _down(x: float) -> float:
    return math.floor(x * 10) / 10


def _budgets(section: Mapping[str, Any]) -> BudgetView:
    members = section.get("members")
    buckets = {
        str(t): {
            str(w): BucketEntry(*e)
            for w, raw in entries.items()
            if (e := _numbers(raw, len(BucketEntry._fields)))
        }
        for t, entries in _section(section, "buckets").items()
        if isinstance(entries, Mapping)
    }
    names = tuple(str(m) for m in members) if isinstance(members, list) else ()
    return BudgetView(names, buckets)


def _holds(entries: list[Any]) -> tuple[PeerHold, ...]:
    """The well-formed `[unreflected, held, remaining, age_s]` entries (the hot path of
    reading a view: one check per field, no intermediate tuples)."""
    holds = []
    for entry in entries:
        if type(entry) is list and len(entry) == 4:
            a, b, c, d = entry
            if type(a) in _NUM and type(b) in _NUM and type(c) in _NUM and type(d) in _NUM:
                holds.append(_new_tuple(PeerHold, entry))
    return tuple(holds)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def _floats(section: Mapping[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in section.items() if _is_number(v)}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any) -> float:
    return float(value) if _is_number(value) else 0.0


def _numbers(value: Any, n: int, optional: bool = False) -> tuple[Any, ...] | None:
    """`value` as `n` floats (None allowed where `optional`), or None when it is not that."""
    if not isinstance(value, list | tuple) or len(value) != n:
        return None
    if all(_is_number(x) or (optional and x is None) for x in value):
        return tuple(None if x is None else float(x) for x in value)
    return None
