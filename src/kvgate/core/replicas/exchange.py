"""The replica exchange: what this replica publishes, and how it takes the others' views.

The flow controller (`kvgate.core.flow`) holds one `ReplicaExchange` and forwards the
shell's three calls to it (`kvgate.cluster.sync` and the simulator make them):

- `local_view()` builds this replica's `PeerView` (`kvgate.core.replicas.view`): its holds
  per node, its claims on each node's slack (`kvgate.core.replicas.claims`, split by
  `peers.share_of` from every replica's queue demand), its queue's demand and its arrivals,
  its tenants' usage, the demand and claims of its limited tenants, the service its
  fairness gave each tenant, and its budgets (`kvgate.core.budgets`: each bucket's counts
  and its claim, split like a tenant's limits). Building it commits the replica to its
  claims: once per exchange, with the view that goes to the store.
- `set_peer_views(views, members)` folds the other replicas' latest views in
  (`peers.merge`): into the policy (their holds in every envelope, their claims), the
  tenant ledger (their usage and claims), the budgets (their counts and claims), and the
  fairness (their service).
- `set_isolated(members)`: the others cannot be seen; the policy, the ledger and the
  budgets keep to a static `1/members` part until views flow again. `members` 0: how many
  replicas share the engines is unknown (this one has never reached the store, and was not
  told): it admits nothing (`refusal`) until views flow.

Either way the replicas it no longer hears from keep their requests in its plans until
they end (`kvgate.core.replicas.departed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvgate.core.admission import Reject
from kvgate.core.budgets import Budgets
from kvgate.core.rates import DecayingRate
from kvgate.core.replicas import peers
from kvgate.core.replicas.departed import Departed
from kvgate.core.replicas.view import PeerView, QueueDemand, TenantDemand
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered
from kvgate.core.tenants import TenantLedger

if TYPE_CHECKING:
    from kvgate.core.admission import AdmissionPolicy
    from kvgate.core.flow.queue import WaitQueue

# Half-life of the arrival rate a replica tells the others (what it will need next).
ARRIVALS_HALFLIFE_S = 1.0

_NO_DEMAND = TenantDemand(0.0, 0.0, 0.0, 0.0)
# Retry-After of a replica that admits nothing until it reaches the store.
BLIND_RETRY_S = 2.0


class ReplicaExchange:
    """One replica's side of the exchange: its name among the replicas (`replica`), its
    arrivals, and the others' demands as of the last sync."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        queue: WaitQueue,
        tenants: TenantLedger,
        replica: str,
        budgets: Budgets | None = None,
    ) -> None:
        self.policy = policy
        self.queue = queue
        self.tenants = tenants
        self.replica = replica
        self.budgets = budgets if budgets is not None else Budgets()
        self._arrivals = DecayingRate(ARRIVALS_HALFLIFE_S)  # tokens submitted per second
        self._peer_demands: list[peers.Demand] = []  # the others' queues, as of the last sync
        self._peer_tenant_queues: list[tuple[str, Mapping[str, TenantDemand]]] = []
        self._peers_at = 0.0
        self.departed = Departed(policy.claims.node_view)
        # Why this replica admits nothing (None: it may); see `set_isolated`.
        self.blind = False

    def arrived(self, now: float, tokens: int) -> None:
        """A request of `tokens` was submitted (to this replica's arrival rate)."""
        self._arrivals.add(now, tokens)

    def local_view(self, now: float) -> PeerView:
        """What this replica publishes now (see the module docstring)."""
        queue = self._queue_demand(now)
        me = self.replica
        since = now - self._peers_at  # the others' heads have waited that much longer too
        demands = [replace(d, head_age_s=d.head_age_s + since) for d in self._peer_demands]
        demands.append(peers.Demand(me, *queue))
        claims = self.policy.claims.claim(lambda _node, slack: peers.share_of(me, demands, slack))
        tenant_queue = self._tenant_demand(now)
        part = self._parts(tenant_queue, since)
        return PeerView(
            replica=me,
            nodes=self.policy.claims.local_holds(now),
            claims=claims,
            prefixes=self.policy.claims.prefixes(),
            queue=queue,
            tenants=self.tenants.local_usage(),
            tenant_queue=tenant_queue,
            tenant_claims=self._claim_tenants(tenant_queue, part),
            service=self.queue.fairness.served(),
            budgets=self.budgets.view(me, part, now),
        )

    def set_peer_views(self, views: Sequence[PeerView], members: int, now: float) -> None:
        """The other live replicas' latest views (`members` counts this one too)."""
        others = [v for v in views if v.replica != self.replica]
        self.blind = False
        self.departed.heard(others, now)
        state = peers.merge(others, now)
        if self.departed:
            explained = {node_id: p.reflected() for node_id, p in state.nodes.items()}
            peers.merge(self.departed.views(now, explained), now, state, departed=True)
        state.members = max(members, len(others) + 1)
        self._peer_demands = [peers.demand_of(v) for v in others]
        self._peers_at = now
        self.policy.set_peers(state)
        self.tenants.peers = state.tenants
        self.tenants.split = 1
        self._peer_tenant_queues = [(v.replica, peers.tenant_demand_of(v)) for v in others]
        self.tenants.set_peer_claims(peers.tenant_claims(others))
        self.budgets.take(others, state.members, self.replica, now)
        self.queue.fairness.set_peer_service(state.service)

    def set_isolated(self, members: int, now: float) -> None:
        """The other replicas cannot be seen: keep to a static `1/members` part of every
        node's room, every tenant's limits and budgets until `set_peer_views` is called
        again (`members` 0: admit nothing, see the module docstring). The replicas heard
        last have departed: their requests stay planned until they end."""
        self.blind = members <= 0
        self.departed.isolated()
        state = peers.PeerState(members=max(1, members), isolated=members != 1)
        peers.merge(self.departed.views(now, {}), now, state, departed=True)
        self._peer_demands = []
        self.policy.set_peers(state)
        self.tenants.peers = {}
        self.tenants.split = max(1, members)
        self._peer_tenant_queues = []
        self.tenants.set_peer_claims(None)
        self.budgets.isolate(members, now)
        self.queue.fairness.set_peer_service({})

    def refusal(self) -> Reject | None:
        """The 503 of a replica that admits nothing (`blind`, see `set_isolated`), None when
        it admits."""
        if not self.blind:
            return None
        return Reject(
            503,
            "store_unreachable",
            jittered(BLIND_RETRY_S, self.policy.rng, MAX_RETRY_AFTER_S),
            "This gateway replica has not reached the cluster store it shares with the other"
            " replicas, so it cannot know what they admit; it admits nothing until it does"
            " (its log says why). Retry shortly, or on another replica.",
        )

    def snapshot(self) -> dict[str, Any]:
        """The replicas as this one sees them, for `/admin/state`."""
        claims = self.policy.claims
        state = claims.peers
        return {
            "replica": self.replica,
            "members": state.members,
            "isolated": state.isolated,
            "blind": self.blind,
            "peer_requests": {n: len(p.loads) - p.departed for n, p in state.nodes.items()},
            "departed_requests": {n: p.departed for n, p in state.nodes.items() if p.departed},
            "allowance_tokens": claims.allowances(),
            "claimed_by_others": {n: p.claimed for n, p in state.nodes.items()},
        }

    def _queue_demand(self, now: float) -> QueueDemand:
        """The queue's claim on room: tokens waiting, its head's need and age, arrivals."""
        head = next(iter(self.queue.order()), None)
        head_tokens = 0
        if head is not None:
            request = head.request
            expected = self.policy.lengths.expected(
                request.model, request.cost.max_output_tokens, request.exact_output
            )
            head_tokens = self.policy.footprint(request, expected)
        return QueueDemand(
            waiting_tokens=self.queue.tokens,
            head_tokens=head_tokens,
            head_age_s=0.0 if head is None else now - head.enqueued_at,
            arrival_tokens_per_s=round(self._arrivals.value(now), 1),
        )

    def _tenant_demand(self, now: float) -> dict[str, TenantDemand]:
        """Per tenant with a limit or a budget and waiters: its waiting requests and tokens,
        and its longest-waiting head's tokens and age (for splitting the tenant's room)."""
        out: dict[str, list[float]] = {}
        for waiter in self.queue.waiting():
            tenant = waiter.request.tenant
            if not self.tenants.is_limited(tenant) and not self.budgets.governs(tenant):
                continue
            entry = out.get(tenant)
            age = now - waiter.enqueued_at
            if entry is None:
                out[tenant] = [1.0, float(waiter.tokens), float(waiter.tokens), age]
            else:
                entry[0] += 1
                entry[1] += waiter.tokens
                if age > entry[3]:
                    entry[2], entry[3] = float(waiter.tokens), age
        return {t: TenantDemand(*entry) for t, entry in out.items()}

    def _claim_tenants(
        self, mine: Mapping[str, TenantDemand], part: Callable[[str, float | None, bool], float]
    ) -> dict[str, tuple[float | None, float | None]]:
        """Claims on each limited tenant's remaining room: `part` of it (`_parts`)."""
        tenants = {*mine, *self.tenants.local_usage(), *self.tenants.peers, *self.tenants.limits}
        for _, queues in self._peer_tenant_queues:
            tenants.update(queues)
        limited = [t for t in sorted(tenants) if self.tenants.is_limited(t)]
        claims = self.tenants.claim(limited, part)
        return {t: (_published(c[0]), _published(c[1])) for t, c in claims.items()}

    def _parts(
        self, mine: Mapping[str, TenantDemand], since: float
    ) -> Callable[[str, float | None, bool], float]:
        """How a tenant's remaining room (its limits', a budget's) is split between the
        replicas, as a node's slack is (`peers.share_of`): what the longest-waiting head
        needs first, then what each replica has waiting, the rest in equal parts."""
        views = [*self._peer_tenant_queues, (self.replica, mine)]

        def part(tenant: str, left: float | None, whole: bool) -> float:
            demands = []
            for name, queues in views:
                count, tokens, head, age = queues.get(tenant) or _NO_DEMAND
                age += 0.0 if name == self.replica else since
                if whole:
                    demands.append(peers.Demand(name, count, 1.0 if count else 0.0, age))
                else:
                    demands.append(peers.Demand(name, tokens, head, age))
            return _part(self.replica, demands, left, whole)

        return part


def _part(me: str, demands: list[peers.Demand], left: float | None, whole: bool) -> float:
    """This replica's part of what a tenant's limit leaves (whole requests when `whole`)."""
    if left is None:
        return float("inf")
    part = peers.share_of(me, demands, left) * left
    return float(int(part + 1e-9)) if whole else part


def _published(claim: float) -> float | None:
    """A claim as published: null for an unlimited part."""
    return None if claim == float("inf") else round(claim, 1)
