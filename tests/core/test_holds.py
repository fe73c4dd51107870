"""The holds on their own: running sums per node, reflection in samples, what a sample holds
twice, and a release that takes everything back (virtual time: tickets and samples are
made by hand)."""

from __future__ import annotations

from kvgate.core.admission import Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.plan.holds import Holds
from kvgate.core.settings import Tuning
from kvgate.core.signals import NodeSample

from .helpers import cost, request

OVH = 16
MARGIN = 0.1


def holds() -> Holds:
    return Holds(Tuning(reflect_margin_s=MARGIN, reservation_overhead_tokens=OVH))


def ticket(key: str, prompt: int, output: int, at: float, node: str = "a") -> Ticket:
    return Ticket(
        request(key, cost(prompt, output)), node, admitted_at=at, key=key, expected_output=output
    )


def sample(at: float, usage: float | None = 0.5) -> NodeSample:
    return NodeSample(usage, 10_000, 1, 0, 0.02, sampled_at=at)


def test_a_hold_counts_its_prompt_now_and_its_cap_at_most() -> None:
    h = holds()
    h.open(ticket("t1", 300, 200, 0.0))
    h.open(ticket("t2", 100, 50, 0.0, node="b"))
    assert h.unreflected_now("a") == 300 + OVH
    assert h.reserved_on("a") == 300 + 200 + OVH
    assert h.prefill_backlog("a") == 300
    assert (h.in_flight_on("a"), h.in_flight_on("b"), h.in_flight_on("c")) == (1, 1, 0)
    assert h.tokens == (300 + 200 + OVH) + (100 + 50 + OVH)


def test_growth_is_counted_now_and_a_first_token_ends_the_prefill() -> None:
    h = holds()
    hold = h.open(ticket("t", 300, 200, 0.0))
    hold.ticket.first_token_at = 0.05
    h.first_token(hold, 0.05)
    assert h.prefill_backlog("a") == 0
    assert h.grow(hold, h.books["a"], 40, 0.2) is None  # the first checkpoint: no pace yet
    assert h.unreflected_now("a") == 300 + 40 + OVH
    assert h.grow(hold, h.books["a"], 50, 0.21) is None  # closer than a third of the margin
    pace = h.grow(hold, h.books["a"], 90, 0.3)
    assert pace is not None and abs(pace - 0.1 / 50) < 1e-12  # (0.3 - 0.2) / (90 - 40)


def test_a_sample_reflects_what_it_can_contain_and_never_less_later() -> None:
    h = holds()
    hold = h.open(ticket("t", 300, 200, 0.0))
    hold.ticket.first_token_at = 1.0
    h.first_token(hold, 1.0)
    h.grow(hold, h.books["a"], 20, 1.0)
    h.reflect(h.books["a"], sample(1.0 + MARGIN / 2))  # too soon after the first token
    assert hold.reflected == 0
    h.reflect(h.books["a"], sample(1.0 + MARGIN))
    assert hold.reflected == 300 + 20  # the prompt and the output known by the cutoff
    assert h.reserved_on("a") == 200 - 20 + OVH
    assert h.unreflected_now("a") == OVH
    h.reflect(h.books["a"], sample(0.5))  # an older cutoff lowers nothing
    assert hold.reflected == 320


def test_a_gaugeless_sample_reflects_nothing() -> None:
    h = holds()
    hold = h.open(ticket("t", 300, 200, 0.0))
    hold.ticket.first_token_at = 0.0
    h.first_token(hold, 0.0)
    h.reflect(h.books["a"], sample(5.0, usage=None))
    assert hold.reflected == 0 and h.overlap("a", sample(5.0, usage=None)) == 0.0


def test_the_overlap_is_what_a_later_sample_most_likely_holds_twice() -> None:
    h = holds()
    sent = h.open(ticket("sent", 300, 200, 1.0))
    h.open(ticket("after", 100, 200, 3.0))  # sent after the sample: not in it
    sent.ticket.first_token_at = 1.5
    h.first_token(sent, 1.5)
    h.grow(sent, h.books["a"], 10, 1.6)
    assert h.overlap("a", sample(2.0)) == 300 + 10
    h.reflect(h.books["a"], sample(2.0))  # reflected now: nothing held twice any more
    h.books["a"].overlap_for = None
    assert h.overlap("a", sample(2.0)) == 0


def test_a_release_takes_back_exactly_what_the_hold_counted() -> None:
    h = holds()
    first = h.open(ticket("t1", 300, 200, 0.0))
    h.open(ticket("t2", 100, 50, 0.0))
    first.ticket.first_token_at = 0.0
    h.first_token(first, 0.0)
    h.grow(first, h.books["a"], 30, 0.0)
    h.reflect(h.books["a"], sample(1.0))
    released = h.release("t1")
    assert released is first and not first.live
    assert h.release("t1") is None  # a second release holds nothing
    assert (h.unreflected_now("a"), h.reserved_on("a")) == (100 + OVH, 100 + 50 + OVH)
    assert h.release("t2") is not None
    assert "a" not in h.books and not h.live and h.tokens == 0


def test_settled_holds_leave_the_wakeup_queue() -> None:
    clock = ManualClock(0.0)
    h = holds()
    for i in range(10):
        hold = h.open(ticket(f"t{i}", 100, 100, clock.now()))
        hold.ticket.first_token_at = 0.0
        h.first_token(hold, 0.0)
        h.grow(hold, h.books["a"], 100, 0.0)  # its whole output, at once
    assert len(h.books["a"].wakeups) == 10
    h.reflect(h.books["a"], sample(1.0))
    assert not h.books["a"].wakeups  # fully reflected: never looked at again
