"""Replicas that admit as one: how a replica folds the others' views in, and splits slack.

Each replica publishes a *view* (`PeerView`, `kvgate.core.replicas.view`) every sync period
and reads the other live replicas' views (the shell moves them, through Redis:
`kvgate.cluster`); `kvgate.core.replicas.exchange` builds and takes them. The core never
waits for that exchange; it folds the latest views in when they arrive (`merge`, here):

- **Holds.** For every node, each live request of the replica as `[unreflected, held,
  remaining, age]`: the tokens the shared sample cannot contain yet, the tokens it holds
  now, the steps it still has to run, and how long ago it was sent to the engine. Other
  replicas' requests enter a node's envelope like this replica's own, so every replica
  plans the same peak. A request's age says what of its unseen tokens a sample most likely
  holds already (one taken after it was sent: a prefill in progress); like a
  replica's own, that over-count stays in admission and leaves the predictions.
- **Claims on the slack.** Between two syncs, replicas cannot see each other's new
  admissions. So each replica, when it publishes its view, *claims* part of every node's
  slack (its ceiling less its planned peak) and, until its next sync, adds requests to a
  node only within what is left of its claim *and* of the slack the others' published
  claims leave (`kvgate.core.replicas.claims`). The store's exchange is atomic (a view in,
  the others' out), so of any two replicas the later one sees the earlier one's claim:
  their claims never overlap, whatever the phases of their ticks. A claim can only shrink
  what a replica may still add, never grow it before it is published. What each replica
  claims is its part of the slack: the replica whose queue head has waited longest (ages
  compared at one instant: each view's age is added) first gets what that head needs; then
  each replica gets what it is expected to need before its next claim (its waiting tokens,
  and its recent arrivals over two sync periods; in proportion when they need more than
  there is), and the rest goes in equal parts, so that no replica is left without room for
  what arrives (a split by demand alone swings the whole room from one replica to another
  sync after sync, since a claim is seen one sync late). Two replicas racing for the last
  room on a node: one sync publishes both heads, the next gives the room to the older one;
  the other waits for the next room.
- **Tenants and fairness.** Each replica's in-flight usage per tenant and its fairness
  counters travel in the view, so tenant limits are counted across replicas and a tenant
  served by one replica is not first in line at another. What a limited tenant's limits
  leave is claimed like a node's slack; a replica starts a limited tenant's request only
  within its claim (so a replica's first request of such a tenant waits for a sync).
- **Departed.** A replica whose view stops arriving (its heartbeat expired, or this one is
  isolated) may still have requests running: they stay in every envelope, aged, until they
  would have ended or a sample shows them gone (`kvgate.core.replicas.departed`).
- **Isolated.** When the store cannot be reached the shell says so with the number of
  members it last saw: each replica then plans its own requests against `1/members` of
  each node's room under its ceiling (`Claims.isolated_headroom`), and of each tenant's
  limits, until views flow again; the departed replicas' requests stay in the envelope.
  The panic gate on measured usage stays on throughout. A replica that has never reached
  the store and was not told how many replicas there are (`members` 0) admits nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvgate.core.replicas.view import PeerView, TenantDemand

# What a replica is expected to need before its claim is renewed: the tokens arriving at
# its recent rate over this horizon (two sync periods) come on top of those waiting.
DEMAND_HORIZON_S = 0.1


@dataclass(slots=True)
class NodePeers:
    """Other replicas' requests on one node."""

    unreflected: float = 0.0  # tokens their samples cannot contain yet
    claimed: float = 0.0  # what they may still add until their next sync (their claims)
    # (sent at, on this replica's clock; unreflected tokens) of each request with some
    # unreflected: what a sample taken after it was sent most likely holds.
    unseen: list[tuple[float, float]] = field(default_factory=list)
    upper: float = 0.0  # unreflected + every remaining step: nothing ends
    loads: list[tuple[float, float]] = field(default_factory=list)  # (remaining, held)
    departed: int = 0  # how many of `loads` are departed replicas' requests
    held: float = 0.0  # the sum of `loads`' held tokens (`merge` keeps it)
    marks: set[int] = field(default_factory=set)  # their held prefixes (`HeldBlocks.marks`)

    def __post_init__(self) -> None:
        if not self.held:
            self.held = sum(held for _, held in self.loads)

    def reflected(self) -> float:
        """Tokens of their requests that the node's samples hold (read on every admission
        decision: kept as a sum, not summed)."""
        return self.held - self.unreflected


@dataclass(slots=True)
class PeerState:
    """What this replica knows of the others, as of the last sync."""

    nodes: dict[str, NodePeers] = field(default_factory=dict)
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # tokens, requests
    service: dict[str, float] = field(default_factory=dict)  # fairness counters, summed
    members: int = 1
    isolated: bool = False


@dataclass(frozen=True, slots=True)
class Demand:
    """One replica's claim on slack: its id, the tokens it has waiting, its head's need, how
    long the head has waited, and the tokens per second arriving at it lately."""

    replica: str
    waiting_tokens: float
    head_tokens: float
    head_age_s: float
    arrival_tokens_per_s: float = 0.0

    @property
    def need(self) -> float:
        """Tokens it is expected to need before its next claim."""
        return self.waiting_tokens + self.arrival_tokens_per_s * DEMAND_HORIZON_S


def merge(
    views: Iterable[PeerView], now: float, state: PeerState | None = None, departed: bool = False
) -> PeerState:
    """Other replicas' views, received at `now`, folded into one state (`state`, when
    given, else a new one). `departed`: the views are departed replicas' requests
    (`kvgate.core.replicas.departed`), counted apart."""
    state = PeerState() if state is None else state
    for view in views:
        published = now - view.age_s
        for node_id, holds in view.nodes.items():
            peers = state.nodes.setdefault(node_id, NodePeers())
            if departed:
                peers.departed += len(holds)
            for unreflected, held, remaining, age in holds:
                peers.unreflected += unreflected
                peers.upper += unreflected + remaining
                peers.loads.append((remaining, held))
                peers.held += held
                if unreflected > 0:
                    peers.unseen.append((published - age, unreflected))
        if not departed:  # a departed replica's requests may have ended: share nothing
            for node_id, marks in view.prefixes.items():
                state.nodes.setdefault(node_id, NodePeers()).marks.update(marks)
        for node_id, claimed in view.claims.items():
            state.nodes.setdefault(node_id, NodePeers()).claimed += claimed
        for tenant, (tokens_used, requests_used) in view.tenants.items():
            tokens, requests = state.tenants.get(tenant, (0, 0))
            state.tenants[tenant] = (tokens + tokens_used, requests + requests_used)
        for tenant, served in view.service.items():
            state.service[tenant] = state.service.get(tenant, 0.0) + served
    return state


def tenant_claims(views: Iterable[PeerView]) -> dict[str, tuple[float, float]]:
    """The other replicas' claims on each tenant's remaining (tokens, requests), summed
    (an unlimited part, null, claims nothing)."""
    out: dict[str, tuple[float, float]] = {}
    for view in views:
        for tenant, (claimed_tokens, claimed_requests) in view.tenant_claims.items():
            tokens, requests = out.get(tenant, (0.0, 0.0))
            out[tenant] = (tokens + (claimed_tokens or 0.0), requests + (claimed_requests or 0.0))
    return out


def demand_of(view: PeerView) -> Demand:
    """A view's queue demand, its head's age as of now (the head has waited since the view
    was published too: ages compare at one instant)."""
    queue = view.queue
    return Demand(
        replica=view.replica,
        waiting_tokens=queue.waiting_tokens,
        head_tokens=queue.head_tokens,
        head_age_s=queue.head_age_s + view.age_s,
        arrival_tokens_per_s=queue.arrival_tokens_per_s,
    )


def tenant_demand_of(view: PeerView) -> dict[str, TenantDemand]:
    """A view's demand per limited tenant, its heads' ages as of now (like `demand_of`)."""
    return {
        tenant: demand._replace(head_age_s=demand.head_age_s + view.age_s)
        for tenant, demand in view.tenant_queue.items()
    }


def share_of(me: str, demands: Sequence[Demand], slack: float) -> float:
    """This replica's fraction of a node's `slack` (see the module docstring); the same
    split on every replica that sees the same demands. The oldest waiting head gets what it
    needs first; then every replica gets what it is expected to need before its next claim
    (in proportion, when they need more than there is), and what is left goes in equal
    parts, so that a replica that is idle now still has room for what arrives."""
    if not demands:
        return 1.0
    if slack <= 0:
        return 1.0 / len(demands)
    whole = slack
    needs = {d.replica: d.need for d in demands}
    mine = 0.0
    waiting = [d for d in demands if d.waiting_tokens > 0]
    if waiting:
        head = max(waiting, key=lambda d: (d.head_age_s, d.replica))
        first = min(slack, head.head_tokens)
        needs[head.replica] = max(0.0, needs[head.replica] - first)
        slack -= first
        if head.replica == me:
            mine += first
    total = sum(needs.values())
    if total >= slack:
        mine += slack * needs.get(me, 0.0) / total if total > 0 else 0.0
    else:
        mine += needs.get(me, 0.0) + (slack - total) / len(demands)
    return max(0.0, min(1.0, mine / whole))
