"""Replicas that admit as one, in virtual time: views exchanged, shares of the slack,
tenant limits across replicas, and the static split when the store cannot be reached."""

from __future__ import annotations

from kvgate.core.admission import Admit, Reject
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.replicas.peers import Demand, share_of
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import TenantLedger, TenantLimits

CAPACITY = 4096


def replicas(
    n: int, clock: ManualClock, tenants: dict[str, TenantLimits] | None = None
) -> list[FlowController]:
    flows = []
    for i in range(n):
        policy = build_policy(AdmissionSettings(), clock, rng_seed=i)
        ledger = TenantLedger(limits=tenants or {})
        flow = FlowController(policy, tenants=ledger, replica=f"r{i}")
        flow.add_node("a")
        flows.append(flow)
    return flows


def sample(flows: list[FlowController], clock: ManualClock, used: int = 0) -> None:
    for flow in flows:
        flow.observe(
            "a",
            NodeSample(used / CAPACITY, CAPACITY, 0, 0, 0.01, clock.now()),
        )


def sync(flows: list[FlowController]) -> None:
    views = [f.local_view() for f in flows]
    for flow in flows:
        flow.set_peer_views(views, len(flows))


def request(rid: str, prompt: int, output: int, tenant: str = "") -> AdmissionRequest:
    return AdmissionRequest(
        rid,
        RequestCost(prompt, output),
        tenant=tenant,
        model="m",
        candidates=("a",),
        exact_output=True,
    )


def test_two_replicas_racing_for_the_last_room_exactly_one_gets_it() -> None:
    clock = ManualClock(10.0)
    a, b = replicas(2, clock)
    sample([a, b], clock)
    # Fill the node from replica a to 2,400 of the 3,768 tokens its ceiling allows.
    for i in range(2):
        assert isinstance(a.submit(request(f"f{i}", 600, 584)), Admit)
    sync([a, b])
    # Both want the remaining ~1,300 tokens, x a little before y.
    first = a.submit(request("x", 700, 584))
    clock.advance(0.01)
    second = b.submit(request("y", 700, 584))
    assert isinstance(first, Waiter) and isinstance(second, Waiter)  # neither has a claim
    # A sync publishes each queue's demand; with the next, both replicas give the slack
    # to the head that waited longer, and only its replica's claim covers it.
    for _ in range(2):
        clock.advance(0.05)
        sync([a, b])
        assert a.policy.in_flight_requests + b.policy.in_flight_requests <= 3
    assert isinstance(first.decision, Admit) and second.decision is None
    assert a.policy.in_flight_requests + b.policy.in_flight_requests == 3


def test_shares_split_the_slack_without_overlap() -> None:
    demands = [
        Demand("r0", 5000, 1200, 3.0),
        Demand("r1", 300, 300, 1.0),
        Demand("r2", 0, 0, 0.0),
    ]
    for slack in (100.0, 1000.0, 1200.0, 5000.0):
        total = sum(share_of(d.replica, demands, slack) for d in demands)
        assert total <= 1.0 + 1e-9
    # The longest-waiting head gets what it needs first.
    assert share_of("r0", demands, 1200.0) * 1200.0 >= 1200.0 - 1e-6
    # With nobody waiting, equal parts.
    idle = [Demand(f"r{i}", 0, 0, 0.0) for i in range(4)]
    assert abs(share_of("r2", idle, 800.0) - 0.25) < 1e-9


def test_a_replica_sees_the_others_requests_in_its_envelope() -> None:
    clock = ManualClock(10.0)
    a, b = replicas(2, clock)
    sample([a, b], clock)
    for i in range(3):
        assert isinstance(a.submit(request(f"f{i}", 600, 584)), Admit)
    sync([a, b])
    # b sees three requests of 1,200 at their ends: a fourth does not fit under 3,768.
    decision = b.submit(request("late", 600, 584))
    assert not isinstance(decision, Admit)


def test_tenant_limits_hold_across_three_replicas() -> None:
    clock = ManualClock(10.0)
    flows = replicas(3, clock, {"t": TenantLimits(max_in_flight_requests=4)})
    sample(flows, clock)
    started = 0
    for round_ in range(4):
        for i, flow in enumerate(flows):
            result = flow.submit(request(f"{round_}-{i}", 10, 10, tenant="t"))
            started += isinstance(result, Admit)
            if isinstance(result, Waiter):
                flow.cancel(result)
        sync(flows)
    held = sum(f.tenants.held("t")[1] for f in flows)
    assert held == started <= 4


def test_isolated_replicas_keep_to_their_part_of_the_node_and_of_tenant_limits() -> None:
    clock = ManualClock(10.0)
    flows = replicas(2, clock, {"t": TenantLimits(max_in_flight_requests=4)})
    sample(flows, clock)
    for flow in flows:
        flow.set_isolated(2)
    admitted = 0
    for i in range(10):
        decision = flows[0].submit(request(f"i{i}", 400, 300))
        admitted += isinstance(decision, Admit)
        if isinstance(decision, Waiter):
            flows[0].cancel(decision)
    # Half of 3,768 holds two requests of 716 at their ends.
    assert admitted == 2
    tenant_started = 0
    for i in range(4):
        decision = flows[1].submit(request(f"t{i}", 10, 10, tenant="t"))
        tenant_started += isinstance(decision, Admit)
        if isinstance(decision, Waiter):
            flows[1].cancel(decision)
    assert tenant_started == 2
    sync(flows)  # views flow again: the static split ends
    assert flows[0].policy.claims.peers.isolated is False


def test_a_peer_view_refusal_is_never_a_503_for_lack_of_capacity() -> None:
    clock = ManualClock(10.0)
    a, b = replicas(2, clock)
    sample([a, b], clock)
    sync([a, b])
    decision = b.submit(request("huge", 3000, 2000))
    assert isinstance(decision, Reject) and decision.status == 400
