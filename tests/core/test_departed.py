"""Replicas this one no longer hears from, and this one alone: a departed replica's requests
stay planned, aged at the node's pace, until they would have ended or a sample shows them
gone; isolated, a request larger than this replica's part starts when it has the node to
itself; a replica that never reached the store and was not told how many replicas there
are admits nothing."""

from __future__ import annotations

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.replicas.departed import AGING_MARGIN
from kvgate.core.replicas.view import PeerHold, PeerView

from .helpers import cost, make_flow, request, sample

STEP_S = 0.02  # the node's step, from its samples' iteration latency


def rig(used: float = 0.3) -> FlowController:
    flow, clock = make_flow(reservation_overhead_tokens=0)
    flow.add_node("a")
    flow.observe("a", sample(clock, usage=used, latency=STEP_S))
    return flow


def them(held: float = 2000, remaining: float = 1000, unreflected: float = 0) -> PeerView:
    return PeerView("them", nodes={"a": (PeerHold(unreflected, held, remaining, 5.0),)})


def planned(flow: FlowController) -> list[tuple[float, float]]:
    """(remaining steps, tokens held) of the other replicas' requests on node a."""
    peers = flow.policy.claims.peers.nodes.get("a")
    return [] if peers is None else sorted(peers.loads)


def test_a_departed_replicas_requests_stay_planned_aged_until_they_would_have_ended() -> None:
    flow = rig()
    clock = flow.clock
    flow.set_peer_views([them()], 2)
    assert planned(flow) == [(1000, 2000)]
    clock.advance(1.0)  # type: ignore[attr-defined]
    flow.observe("a", sample(clock, usage=0.3, latency=STEP_S))  # it is still in the samples
    flow.set_peer_views([], 1)  # its heartbeat expired
    steps = 1.0 / (STEP_S * AGING_MARGIN)
    assert planned(flow) == [(1000 - steps, 2000 + steps)]
    snap = flow.exchange.snapshot()
    assert snap["peer_requests"] == {"a": 0} and snap["departed_requests"] == {"a": 1}
    clock.advance(1000 * STEP_S * AGING_MARGIN)  # type: ignore[attr-defined]
    flow.set_peer_views([], 1)
    assert planned(flow) == [] and flow.exchange.snapshot()["departed_requests"] == {}


def test_a_sample_that_holds_less_than_the_departed_requests_drops_them() -> None:
    flow = rig()
    clock = flow.clock
    flow.set_peer_views([them()], 2)
    clock.advance(0.5)  # type: ignore[attr-defined]
    flow.set_peer_views([], 1)
    assert planned(flow)  # no sample since: kept
    flow.observe("a", sample(clock, usage=0.05, latency=STEP_S))  # 500 tokens: it is gone
    flow.set_peer_views([], 1)
    assert planned(flow) == []


def test_a_request_no_sample_had_seen_is_kept_until_it_would_have_ended() -> None:
    flow = rig()
    clock = flow.clock
    flow.set_peer_views([them(held=2000, unreflected=2000)], 2)
    clock.advance(0.5)  # type: ignore[attr-defined]
    flow.set_peer_views([], 1)
    flow.observe("a", sample(clock, usage=0.0, latency=STEP_S))
    flow.set_peer_views([], 1)
    assert len(planned(flow)) == 1


def test_a_replica_heard_again_is_live_again() -> None:
    flow = rig()
    flow.set_peer_views([them()], 2)
    flow.set_peer_views([], 1)
    assert flow.exchange.snapshot()["departed_requests"] == {"a": 1}
    flow.set_peer_views([them(held=2100, remaining=900)], 2)
    assert planned(flow) == [(900, 2100)]
    assert flow.exchange.snapshot()["departed_requests"] == {}


def test_isolated_the_replicas_heard_last_have_departed_and_count() -> None:
    flow = rig(used=0.6)
    flow.set_peer_views([them(held=6000, remaining=2000)], 2)
    flow.set_isolated(2)
    state = flow.policy.claims.peers
    assert state.isolated and state.members == 2
    assert planned(flow) == [(2000, 6000)]
    # Within its part (4,600 tokens), but not within the node's ceiling (9,200) next to
    # the departed request that grows to 8,000: refused; a smaller one fits both.
    refused = flow.policy.admit(request("r", cost(1500, 1000), exact_output=True))
    assert isinstance(refused, Reject)
    assert isinstance(flow.submit(request("fits", cost(1000, 1000), exact_output=True)), Admit)


def test_isolated_a_request_larger_than_the_part_starts_when_the_node_is_its_own() -> None:
    flow = rig(used=0.0)
    flow.set_isolated(3)  # its part: a third of 9,200 tokens under the ceiling
    large = request("large", cost(3000, 2000), exact_output=True)  # 5,000 at its end
    first = flow.submit(large)
    assert isinstance(first, Admit)
    # A second one waits for the first to end (it no longer has the node to itself), and
    # so does a small one behind it: this replica is over its part already.
    second = flow.submit(request("large-2", cost(3000, 2000), exact_output=True))
    assert isinstance(second, Waiter)
    small = flow.submit(request("small", cost(100, 100)))
    assert isinstance(small, Waiter | Reject) and not isinstance(small, Admit)
    flow.release(first.ticket, Outcome.DONE)
    assert isinstance(second.decision, Admit)


def test_a_replica_that_never_synced_and_knows_no_count_admits_nothing() -> None:
    flow = rig()
    flow.set_isolated(0)
    refused = flow.submit(request("r", cost(100, 100)))
    assert isinstance(refused, Reject)
    assert (refused.status, refused.reason) == (503, "store_unreachable")
    assert refused.retry_after_s > 0 and flow.exchange.snapshot()["blind"]
    flow.set_peer_views([], 1)  # its first sync
    assert isinstance(flow.submit(request("r2", cost(100, 100))), Admit)
