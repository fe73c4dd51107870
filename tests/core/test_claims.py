"""The replica claims on their own: a claim is a share of each node's slack, the allowance
until the next sync is what is left of it and of what the others' claims leave, and every
start spends from both."""

from __future__ import annotations

from kvgate.core.admission import Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.nodes import NodeState
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Holds
from kvgate.core.plan.pace import Pace
from kvgate.core.replicas.claims import Claims
from kvgate.core.replicas.peers import NodePeers, PeerState
from kvgate.core.replicas.view import PeerHold
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

from .helpers import cost, request

CAP = 10_000
PANIC = 0.9


def rig(used: int = 1000) -> tuple[Claims, Holds, ManualClock]:
    clock = ManualClock(10.0)
    settings = AdmissionSettings(panic_watermark=PANIC).tuned(reservation_overhead_tokens=0)
    nodes = {"a": NodeState("a")}
    nodes["a"].accept(NodeSample(used / CAP, CAP, 0, 0, 0.02, 10.0), 10.0, settings)
    holds = Holds(settings.tuning)
    forecast = Forecast(settings, clock, holds, Pace(nodes))
    return Claims(settings, nodes, holds, forecast), holds, clock


def test_alone_nothing_is_claimed_and_nothing_limits() -> None:
    claims, _, _ = rig()
    assert claims.slack("a") == PANIC * CAP - 1000
    assert claims.slack("unknown") == 0.0
    assert claims.allowance("a") is None and claims.allowances() == {"a": None}


def test_a_claim_is_a_share_of_the_slack_and_bounds_the_allowance() -> None:
    claims, _, _ = rig()
    published = claims.claim(lambda _node, _slack: 0.25)
    assert published == {"a": 0.25 * 8000}
    others = PeerState(nodes={"a": NodePeers(claimed=7000)}, members=2)
    claims.set_peers(others)
    assert claims.allowance("a") == 8000 - 7000  # what the others leave, under the claim
    claims.spend("a", 600)
    assert claims.allowance("a") == 400 and claims.claimed["a"] == 2000 - 600
    claims.claim(lambda _node, _slack: 0.01)  # a smaller claim shrinks it at once
    assert claims.allowance("a") == 0.01 * 8000


def test_isolated_the_claims_end_and_nothing_limits_through_them() -> None:
    claims, _, _ = rig()
    claims.claim(lambda _node, _slack: 0.5)
    claims.set_peers(PeerState(members=3, isolated=True))
    assert claims.claimed == {} and claims.allowance("a") is None
    assert claims.peers.isolated


def test_local_holds_are_what_the_view_tells_of_each_request() -> None:
    claims, holds, clock = rig()
    hold = holds.open(Ticket(request("x", cost(300, 100)), "a", clock.now(), "x", 100))
    clock.advance(1.5)
    assert claims.local_holds(clock.now()) == {"a": (PeerHold(300, 300, 100, 1.5),)}
    hold.reflected = 300
    assert claims.local_holds(clock.now())["a"][0].unreflected == 0
