"""Replicas that admit as one: what a replica tells the others, and how it uses theirs.

Each replica publishes a *view* (a JSON-able dict) every sync period and reads the other
live replicas' views (the shell moves them, through Redis: `kvgate.cluster`). The core
never waits for that exchange; it folds the latest views in when they arrive:

- **Holds.** For every node, each live request of the replica as `[unreflected, held,
  remaining, age]`: the tokens the shared sample cannot contain yet, the tokens it holds
  now, the steps it still has to run, and how long ago it was sent to the engine. Other
  replicas' requests enter a node's envelope like this replica's own, so every replica
  plans the same peak. A request's age says what of its unseen tokens a sample most likely
  holds already (one taken a margin after it was sent: a prefill in progress); like a
  replica's own, that over-count stays in admission and leaves the predictions.
- **Claims on the slack.** Between two syncs, replicas cannot see each other's new
  admissions. So each replica, when it publishes its view, *claims* part of every node's
  slack (its ceiling less its planned peak) and, until its next sync, adds requests to a
  node only within what is left of its claim *and* of the slack the others' published
  claims leave. The store's exchange is atomic (a view in, the others' out), so of any two
  replicas the later one sees the earlier one's claim: their claims never overlap, whatever
  the phases of their ticks. A claim can only shrink what a replica may still add, never
  grow it before it is published. What each replica claims is its part of the slack: the
  replica whose queue head has waited longest (ages compared at one instant: each view's
  age is added) first gets what that head needs, and the rest goes by the tokens each
  replica has waiting (equal parts when none has any). Two replicas racing for the last
  room on a node: one sync publishes both heads, the next gives the room to the older one;
  the other waits for the next room.
- **Tenants and fairness.** Each replica's in-flight usage per tenant and its fairness
  counters travel in the view, so tenant limits are counted across replicas and a tenant
  served by one replica is not first in line at another. What a limited tenant's limits
  leave is claimed like a node's slack; a replica starts a limited tenant's request only
  within its claim (so a replica's first request of such a tenant waits for a sync).
- **Isolated.** When the store cannot be reached the shell says so with the number of
  members it last saw: each replica then plans only its own requests against `1/members` of
  each node's room under its ceiling, and of each tenant's limits, until views flow again.
  The panic gate on measured usage stays on throughout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A replica's demand counts at least this many tokens, so that replicas with nothing
# waiting still get an even part of the slack for what arrives before the next sync.
_DEMAND_FLOOR = 1.0


@dataclass(slots=True)
class NodePeers:
    """Other replicas' requests on one node."""

    unreflected: float = 0.0  # tokens their samples cannot contain yet
    claimed: float = 0.0  # what they may still add until their next sync (their claims)
    # (sent at, on this replica's clock; unreflected tokens) of each request with some
    # unreflected: what a sample taken a margin after it was sent most likely holds.
    unseen: list[tuple[float, float]] = field(default_factory=list)
    upper: float = 0.0  # unreflected + every remaining step: nothing ends
    loads: list[tuple[float, float]] = field(default_factory=list)  # (remaining, held)


@dataclass(slots=True)
class PeerState:
    """What this replica knows of the others, as of the last sync."""

    nodes: dict[str, NodePeers] = field(default_factory=dict)
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # tokens, requests
    service: dict[str, float] = field(default_factory=dict)  # fairness counters, summed
    share: float = 1.0  # this replica's part of each node's slack until the next sync
    members: int = 1
    isolated: bool = False


@dataclass(frozen=True, slots=True)
class Demand:
    """One replica's claim on slack: its id, the tokens it has waiting, its head's need and
    how long the head has waited."""

    replica: str
    waiting_tokens: float
    head_tokens: float
    head_age_s: float


def merge(views: Iterable[Mapping[str, Any]], now: float) -> PeerState:
    """Other replicas' views, received at `now`, folded into one state."""
    state = PeerState()
    for view in views:
        published = now - float(view.get("view_age_s", 0.0))
        for node_id, holds in (view.get("nodes") or {}).items():
            peers = state.nodes.setdefault(str(node_id), NodePeers())
            for entry in holds:
                unreflected, held, remaining, age = (float(x) for x in entry)
                peers.unreflected += unreflected
                peers.upper += unreflected + remaining
                peers.loads.append((remaining, held))
                if unreflected > 0:
                    peers.unseen.append((published - age, unreflected))
        for node_id, claimed in (view.get("claims") or {}).items():
            state.nodes.setdefault(str(node_id), NodePeers()).claimed += float(claimed)
        for tenant, usage in (view.get("tenants") or {}).items():
            tokens, requests = state.tenants.get(str(tenant), (0, 0))
            state.tenants[str(tenant)] = (tokens + int(usage[0]), requests + int(usage[1]))
        for tenant, served in (view.get("service") or {}).items():
            state.service[str(tenant)] = state.service.get(str(tenant), 0.0) + float(served)
    return state


def tenant_claims(views: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """The other replicas' claims on each tenant's remaining (tokens, requests), summed
    (an unlimited part, null, claims nothing)."""
    out: dict[str, tuple[float, float]] = {}
    for view in views:
        for tenant, claim in (view.get("tenant_claims") or {}).items():
            tokens, requests = out.get(str(tenant), (0.0, 0.0))
            out[str(tenant)] = (tokens + float(claim[0] or 0), requests + float(claim[1] or 0))
    return out


def demand_of(view: Mapping[str, Any]) -> Demand:
    queue = view.get("queue") or {}
    return Demand(
        replica=str(view.get("replica", "")),
        waiting_tokens=float(queue.get("waiting_tokens", 0.0)),
        head_tokens=float(queue.get("head_tokens", 0.0)),
        # The head has waited since the view was published too: ages compare at one instant.
        head_age_s=float(queue.get("head_age_s", 0.0)) + float(view.get("view_age_s", 0.0)),
    )


def share_of(me: str, demands: Sequence[Demand], slack: float) -> float:
    """This replica's fraction of a node's `slack` (see the module docstring); the same
    split on every replica that sees the same demands."""
    if not demands:
        return 1.0
    if slack <= 0:
        return 1.0 / len(demands)
    waiting = [d for d in demands if d.waiting_tokens > 0]
    first_take = 0.0
    first: str | None = None
    if waiting:
        head = max(waiting, key=lambda d: (d.head_age_s, d.replica))
        first, first_take = head.replica, min(slack, head.head_tokens)
    rest = slack - first_take
    weights = {d.replica: max(_DEMAND_FLOOR, d.waiting_tokens) for d in demands}
    if first is not None:
        weights[first] = max(_DEMAND_FLOOR, weights[first] - first_take)
    total = sum(weights.values())
    mine = rest * weights.get(me, 0.0) / total if total > 0 else 0.0
    if me == first:
        mine += first_take
    return max(0.0, min(1.0, mine / slack))
