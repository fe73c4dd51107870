"""A refusal names its real cause: the planned peak against the ceiling (and what the engine
reports), the other replicas' claims, or the engines' own queues; the flow controller keeps
the planned peak of its last such refusal for /admin/state."""

from __future__ import annotations

from kvgate.core.admission import Admit, Reject
from kvgate.core.flow import FlowController
from kvgate.core.replicas.peers import PeerState
from kvgate.core.request import Priority

from .helpers import admit, cost, make, request, sample


def test_a_refusal_by_the_plan_names_the_planned_peak_the_ceiling_and_the_usage() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.04, capacity=4096))
    # Nothing learned yet: each of these is planned at its whole 1,800 output tokens.
    assert isinstance(admit(policy, "first", cost(20, 1800)), Admit)
    refused = admit(policy, "second", cost(20, 1800))
    assert isinstance(refused, Reject) and refused.waitable
    assert refused.reason == "kv_planned_peak"
    planned = refused.planned
    assert planned is not None and planned.node_id == "a"
    assert planned.usage == 0.04 and planned.ceiling == 0.92
    assert abs(planned.peak - (0.04 * 4096 + 2 * 1836) / 4096) < 1e-9  # 94%
    assert "94%" in refused.message and "92%" in refused.message
    assert "4% now" in refused.message and "too full" not in refused.message


def test_the_flow_controller_shows_the_planned_peak_that_refused_a_request() -> None:
    policy, clock = make()
    flow = FlowController(policy)
    flow.observe("a", sample(clock, usage=0.04, capacity=4096))
    assert flow.snapshot()["refused_peak"] is None
    assert isinstance(flow.submit(request("first", cost(20, 1800))), Admit)
    clock.advance(1.0)
    refused = flow.submit(request("second", cost(20, 1800), max_wait_s=0.0))
    assert isinstance(refused, Reject) and refused.reason == "kv_planned_peak"
    assert refused.planned is not None
    clock.advance(2.0)
    shown = flow.snapshot()["refused_peak"]
    assert shown == {
        "age_s": 2.0,
        "priority": "standard",
        "node": "a",
        "planned_peak": round(refused.planned.peak, 4),
        "ceiling": 0.92,
        "kv_usage": 0.04,
    }


def test_room_held_by_the_other_replicas_is_named_as_theirs() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.0, capacity=4096))
    policy.claims.claimed = {"a": 1000.0}
    policy.set_peers(PeerState(members=2))
    refused = admit(policy, "big", cost(1000, 1000))
    assert isinstance(refused, Reject) and refused.reason == "replica_claim"
    assert refused.waitable and refused.planned is None


def test_engines_without_a_gauge_refuse_by_their_own_queues() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=None, capacity=None, waiting=3))
    refused = admit(policy, "r", cost(10, 10), Priority.CRITICAL)
    assert isinstance(refused, Reject) and refused.reason == "engine_queue"
