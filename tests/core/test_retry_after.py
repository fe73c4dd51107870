"""Retry-After: the predicted wait, else excess over the freeing rate; +-20 % jitter, >= 1 s."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.request import Priority
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, retry_after, retry_after_centre

from .helpers import cost, make_flow, request, sample


@settings(max_examples=300, deadline=None)
@given(
    excess=st.floats(min_value=-1e6, max_value=1e9, allow_nan=False),
    rate=st.floats(min_value=0, max_value=1e7, allow_nan=False),
    max_s=st.floats(min_value=1, max_value=600, allow_nan=False),
    seed=st.integers(0, 2**32),
)
def test_within_twenty_percent_of_centre_and_never_below_one_second(
    excess: float, rate: float, max_s: float, seed: int
) -> None:
    centre = retry_after_centre(excess, rate, max_s)
    assert 1.0 <= centre <= max_s
    value = retry_after(excess, rate, max_s, random.Random(seed))
    assert 1.0 <= value <= max_s
    assert 0.8 * centre - 1e-9 <= value <= 1.2 * centre + 1e-9


def test_centre_is_excess_over_freeing_rate() -> None:
    assert retry_after_centre(5000, 1000, 30) == 5.0
    assert retry_after_centre(5000, 0, 30) == 30  # nothing frees: the maximum
    assert retry_after_centre(10, 1000, 30) == 1.0  # never below one second
    assert retry_after_centre(10**9, 1, 30) == 30


def test_jitter_spreads_values_over_the_whole_band() -> None:
    rng = random.Random(11)
    values = [retry_after(10_000, 1000, 30, rng) for _ in range(2000)]
    assert min(values) < 8.1 and max(values) > 11.9
    assert 9.8 < sum(values) / len(values) < 10.2


def _steady_release(flow: FlowController, clock: ManualClock) -> float:
    """A minute of 1,000 tokens freed per second (one 100-token request per 0.1 s)."""
    flow.observe("a", sample(clock, usage=0.0, capacity=100_000))
    for i in range(600):
        decision = flow.submit(request(f"r{i}", cost(50, 50)))
        assert isinstance(decision, Admit)
        clock.advance(0.1)
        flow.release(decision.ticket, Outcome.DONE)
        flow.observe("a", sample(clock, usage=0.0, capacity=100_000))
    rate = flow.snapshot()["released_tokens_per_s"]
    assert 950 < rate < 1050
    return float(rate)


def test_retry_after_is_the_predicted_start_when_the_node_is_full_of_known_requests() -> None:
    """A client that will not wait is told when its request could start: when enough of
    what runs on the node will have ended, at the node's measured step time."""
    flow, clock = make_flow(reservation_overhead_tokens=0)
    flow.observe("a", sample(clock, usage=0.0, capacity=10_000, latency=0.02))
    for i in range(2):  # 2 x 4,500 of the 9,200 tokens under panic, each ending in 500 steps
        assert isinstance(flow.submit(request(f"r{i}", cost(4000, 500))), Admit)
    refused = flow.submit(request("late", cost(4000, 500), max_wait_s=0))
    assert isinstance(refused, Reject) and refused.status == 429
    centre = 500 * 0.02  # the first end frees room for it
    assert 0.8 * centre - 1e-9 <= refused.retry_after_s <= 1.2 * centre + 1e-9
    waiting = flow.submit(request("patient", cost(4000, 500)))
    assert isinstance(waiting, Waiter)  # 10 s is within the standard bound: it waits
    flow.cancel(waiting)


def test_retry_after_falls_back_to_the_measured_release_rate() -> None:
    """Nothing the gateway placed is running to end: the measured rate at which the
    cluster freed tokens says when the node will have shed what stands between it and the
    request (its excess over the ceiling, and the request's own size)."""
    flow, clock = make_flow(reservation_overhead_tokens=0, release_rate_halflife_s=5.0)
    rate = _steady_release(flow, clock)
    # Load the gateway cannot see fills the node past every ceiling.
    flow.observe("a", sample(clock, usage=0.95, capacity=100_000))
    refused = flow.submit(request("x", cost(2500, 2500), Priority.SHEDDABLE))
    assert isinstance(refused, Reject) and refused.status == 429
    # The node's ceiling for sheddable work: the high watermark, less the margin that load
    # beyond the plan has raised; a wait past the clamp is told as the clamp.
    ceiling = flow.policy.ceiling(flow.policy.nodes["a"], Priority.SHEDDABLE)  # type: ignore[attr-defined]
    assert ceiling < 0.80
    centre = min(MAX_RETRY_AFTER_S, (0.95 * 100_000 + 5000 - ceiling * 100_000) / rate)
    assert 0.8 * centre <= refused.retry_after_s <= 1.2 * centre


def test_retry_after_covers_the_excess_over_the_ceiling() -> None:
    flow, clock = make_flow(reservation_overhead_tokens=0, release_rate_halflife_s=5.0)
    rate = _steady_release(flow, clock)
    # Now the node is full; a sheddable request of 100 tokens is over its ceiling by the
    # node's excess, 100 tokens and the margin that load beyond the plan raised.
    flow.observe("a", sample(clock, usage=0.90, capacity=100_000))
    refused = flow.submit(request("x", cost(50, 50), Priority.SHEDDABLE))
    assert isinstance(refused, Reject) and refused.status == 429
    ceiling = flow.policy.ceiling(flow.policy.nodes["a"], Priority.SHEDDABLE)  # type: ignore[attr-defined]
    centre = min(MAX_RETRY_AFTER_S, (0.90 * 100_000 + 100 - ceiling * 100_000) / rate)
    assert 0.8 * centre <= refused.retry_after_s <= 1.2 * centre
