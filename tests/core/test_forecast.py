"""The forecast on its own: a node's envelope from its holds, the other replicas' requests
; what a sample is taken to hold; its cache; and the drain and start predictions in seconds."""

from __future__ import annotations

from kvgate.core.admission import Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.nodes import NodeState
from kvgate.core.plan.envelope import Envelope
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Holds
from kvgate.core.plan.pace import Pace
from kvgate.core.replicas.peers import NodePeers, PeerState
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

from .helpers import cost, request

CAP = 10_000
STEP_S = 0.02


class Rig:
    """One node `a` sampled at `used` tokens, its holds, pace and forecast."""

    def __init__(self, used: int = 1000) -> None:
        self.clock = ManualClock(10.0)
        self.settings = AdmissionSettings().tuned(reservation_overhead_tokens=0)
        self.nodes = {"a": NodeState("a")}
        self.nodes["a"].accept(
            NodeSample(used / CAP, CAP, 1, 0, STEP_S, self.clock.now()), 10.0, self.settings
        )
        self.holds = Holds(self.settings.tuning)
        self.forecast = Forecast(self.settings, self.clock, self.holds, Pace(self.nodes))

    @property
    def node(self) -> NodeState:
        return self.nodes["a"]

    def start(self, key: str, prompt: int, expected: int) -> None:
        ticket = Ticket(request(key, cost(prompt, expected)), "a", self.clock.now(), key, expected)
        self.forecast.opened(self.holds.open(ticket))


def test_the_envelope_is_the_sample_plus_every_hold_and_the_peers() -> None:
    rig = Rig(used=1000)
    rig.start("x", 300, 200)
    env = rig.forecast.envelope(rig.node)
    expected = Envelope(1000 + 300, [(200, 300)])
    assert (env.base, env.peak()) == (expected.base, expected.peak()) == (1300, 1500)
    peers = PeerState(nodes={"a": NodePeers(unreflected=50, loads=[(100, 50)], upper=150)})
    rig.forecast.set_peers(peers)
    env = rig.forecast.envelope(rig.node)
    assert env.base == 1350 and len(env) == 2
    assert rig.forecast.peers_upper("a") == 150


def test_a_sample_is_never_taken_to_hold_less_than_the_holds_it_reflects() -> None:
    """A page rendered after the engine ended a request whose end is not read yet lacks its
    blocks: counted from the page alone they would be freed twice (there and at the
    planned end), so `used` is at least what the holds take the page to contain."""
    rig = Rig(used=0)
    rig.start("x", 300, 200)
    hold, book = rig.holds.live["x"], rig.holds.books["a"]
    hold.ticket.first_token_at = rig.clock.now()
    rig.holds.first_token(hold, rig.clock.now())
    rig.clock.advance(1.0)
    sample = NodeSample(100 / CAP, CAP, 0, 0, STEP_S, rig.clock.now())  # x already gone
    rig.node.accept(sample, rig.clock.now(), rig.settings)
    rig.holds.reflect(book, sample)
    rig.forecast.observed("a", book)
    assert rig.holds.reflected_on("a") == 300  # its prompt, in the page as far as we know
    assert rig.forecast.used(rig.node) == 300
    env = rig.forecast.envelope(rig.node)
    assert env.base_after_all() == 0  # freed once, at its end
    rig.node.accept(NodeSample(2000 / CAP, CAP, 1, 0, STEP_S, rig.clock.now()), 11.0, rig.settings)
    assert rig.forecast.used(rig.node) == 2000  # a page that holds more is taken as it is
    rig.holds.release("x")
    rig.node.freed_unseen += 300  # what the policy's release does
    assert rig.forecast.used(rig.node) == 2000
    env = rig.forecast.envelope(rig.node)
    assert env.peak() == 2000 and env.base_after_all() == 1700  # it ends now, once


def test_the_cached_envelope_takes_starts_and_goes_with_a_sample() -> None:
    rig = Rig()
    rig.start("x", 300, 200)
    cached = rig.forecast.envelope(rig.node)
    assert rig.forecast.envelope(rig.node) is cached
    rig.start("y", 100, 50)  # added in place, not rebuilt
    assert rig.forecast.envelope(rig.node) is cached and len(cached) == 2
    rig.forecast.observed("a", rig.holds.books["a"])
    assert rig.forecast.envelope(rig.node) is not cached


def test_a_request_past_its_expected_length_rebuilds_the_envelope() -> None:
    rig = Rig()
    rig.start("x", 100, 50)  # cap 50: expected == cap, it only grows
    cached = rig.forecast.envelope(rig.node)
    hold = rig.holds.live["x"]
    book = rig.holds.books["a"]
    rig.forecast.progressed(hold, book, 10)
    assert rig.forecast.envelope(rig.node) is cached and cached.base == 1000 + 100 + 10
    hold.expected = 20  # from now on it runs to its cap: a longer future
    rig.holds.grow(hold, book, 10, rig.clock.now())
    rig.forecast.progressed(hold, book, 30)
    assert rig.forecast.envelope(rig.node) is not cached


def test_drain_time_follows_the_ends_at_the_nodes_pace() -> None:
    rig = Rig()
    rig.start("short", 100, 10)
    rig.start("long", 200, 100)
    drain = rig.forecast.drain_time
    assert drain(0, ("a",), 0) == 0.0
    assert abs(drain(110, ("a",), 0) - 10 * STEP_S) < 1e-9  # the short one's end frees 110
    assert abs(drain(410, ("a",), 0) - 100 * STEP_S) < 1e-9  # and the long one's 300
    assert drain(820, ("a",), 0) > 100 * STEP_S  # beyond the last end: extrapolated
    assert drain(1, ("b",), 0) is None  # nothing runs there, nothing measured freeing
    rig.forecast.freed.add(rig.clock.now(), 1000)
    assert drain(1, ("b",), 1) is not None


def test_a_start_estimate_is_the_first_end_after_which_it_fits() -> None:
    rig = Rig(used=0)
    rig.start("x", 1000, 50)
    limit = 1200.0
    estimate = rig.forecast.start_estimate(rig.node, 300, limit)
    assert estimate is not None and estimate.node_id == "a"
    assert abs(estimate.seconds - 50 * STEP_S) < 1e-9 and estimate.soonest_s <= estimate.seconds
    assert rig.forecast.start_estimate(rig.node, 300, 1500)  # fits now
    assert rig.forecast.start_estimate(rig.node, 2000, limit) is None  # never


def test_the_panic_gates_usage_leaves_out_what_the_sample_holds_twice() -> None:
    rig = Rig(used=1000)
    rig.clock.advance(1.0)
    rig.start("x", 500, 100)  # sent after the sample: it holds none of it yet
    assert rig.forecast.usage_now(rig.node) == (1000 + 500) / CAP
    rig.node.accept(NodeSample(0.15, CAP, 1, 0, STEP_S, 12.0), 12.0, rig.settings)
    assert rig.forecast.unseen_overlap(rig.node) == 500  # the next sample likely holds it
    assert rig.forecast.usage_now(rig.node) == 1500 / CAP
    peers = NodePeers(unreflected=80, unseen=[(11.5, 80)])
    rig.forecast.set_peers(PeerState(nodes={"a": peers}))
    assert rig.forecast.unseen_overlap(rig.node) == 580
