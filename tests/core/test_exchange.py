"""The replica exchange on its own: what this replica's view says, and what it takes from
the others' (their holds and claims to the policy, their usage and claims to the tenants,
their service to the fairness); isolated, a static part of everything."""

from __future__ import annotations

from kvgate.core.admission import Admit
from kvgate.core.clock import ManualClock
from kvgate.core.flow import TokenFairness, Waiter, WaitQueue
from kvgate.core.policies import build_policy
from kvgate.core.replicas.exchange import ReplicaExchange
from kvgate.core.replicas.view import PeerHold, PeerView, QueueDemand, TenantDemand
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import TenantLedger, TenantLimits

from .helpers import cost, request

CAP = 10_000


def rig() -> tuple[ReplicaExchange, ManualClock]:
    clock = ManualClock(10.0)
    policy = build_policy(AdmissionSettings(), clock, rng_seed=1)
    policy.observe("a", NodeSample(0.1, CAP, 0, 0, 0.02, clock.now()))
    ledger = TenantLedger(limits={"acme": TenantLimits(max_in_flight_tokens=5000)})
    return ReplicaExchange(policy, WaitQueue(TokenFairness()), ledger, "me"), clock


def wait(exchange: ReplicaExchange, tenant: str, tokens: int, at: float) -> None:
    c = cost(tokens // 2, tokens - tokens // 2)
    r = request(f"w{exchange.queue.next_seq()}", c, tenant=tenant, exact_output=True)
    exchange.queue.push(Waiter(r, at, at + 60, exchange.queue.next_seq(), tokens))


def test_the_view_tells_holds_claims_queue_and_tenants() -> None:
    exchange, clock = rig()
    assert isinstance(exchange.policy.admit(request("run", cost(300, 100))), Admit)
    exchange.tenants.acquire("acme", 400)
    exchange.arrived(clock.now(), 400)
    wait(exchange, "acme", 1000, clock.now())
    clock.advance(2.0)
    view = exchange.local_view(clock.now())
    assert view.replica == "me"
    assert view.nodes["a"][0] == PeerHold(316, 316, 100, 2.0)
    assert view.claims["a"] > 0  # alone, it claims the node's whole slack
    assert view.queue.waiting_tokens == 1000 and view.queue.head_age_s == 2.0
    assert view.queue.head_tokens == 500 + 500 + 16
    assert view.tenants == {"acme": (400, 1)}
    assert view.tenant_queue == {"acme": TenantDemand(1.0, 1000.0, 1000.0, 2.0)}
    assert view.tenant_claims["acme"][1] is None  # no limit on its requests: no claim


def test_the_others_views_reach_policy_tenants_and_fairness() -> None:
    exchange, clock = rig()
    other = PeerView(
        "them",
        nodes={"a": (PeerHold(200, 200, 50, 0.5),)},
        claims={"a": 3000.0},
        queue=QueueDemand(800, 800, 1.0),
        tenants={"acme": (1000, 2)},
        service={"acme": 42.0},
        age_s=0.05,
    )
    mine = PeerView("me", claims={"a": 99.0})
    exchange.set_peer_views([other, mine], members=2, now=clock.now())
    peers = exchange.policy.claims.peers
    assert peers.members == 2 and not peers.isolated
    assert peers.nodes["a"].claimed == 3000.0 and peers.nodes["a"].loads == [(50, 200)]
    assert exchange.tenants.peers == {"acme": (1000, 2)}
    assert exchange.queue.fairness._peers == {"acme": 42.0}  # type: ignore[attr-defined]
    snap = exchange.snapshot()
    assert snap["members"] == 2 and snap["peer_requests"] == {"a": 1}
    assert snap["claimed_by_others"] == {"a": 3000.0}
    # The other replica waits for room, this one does not: its claim is a part of the slack.
    view = exchange.local_view(clock.now() + 0.5)
    assert 0 < view.claims["a"] < exchange.policy.claims.slack("a")


def test_isolated_everything_is_split_statically() -> None:
    exchange, _ = rig()
    exchange.set_isolated(4, 0.0)
    assert exchange.policy.claims.peers.isolated and exchange.policy.claims.peers.members == 4
    assert exchange.tenants.split == 4 and exchange.tenants.allowance is None
    assert exchange.tenants.limits_for("acme").max_in_flight_tokens == 5000 // 4
    exchange.set_isolated(1, 0.0)  # alone: nothing to split
    assert not exchange.policy.claims.peers.isolated
