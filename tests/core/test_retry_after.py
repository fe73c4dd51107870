"""Retry-After: centred on excess / freed rate, +-20 % jitter, never below 1 s, clamped."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.request import Priority
from kvgate.core.retry_after import retry_after, retry_after_centre

from .helpers import cost, make, sample


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


def test_policy_retry_after_follows_the_measured_release_rate() -> None:
    policy, clock = make(reservation_overhead_tokens=0, release_rate_halflife_s=5.0)
    policy.observe("a", sample(clock, usage=0.0, capacity=100_000))
    # Steady state: 1,000 tokens freed per second for a minute (one 100-token request per 0.1 s).
    for i in range(600):
        decision = policy.admit(f"r{i}", cost(50, 50), Priority.STANDARD, ["a"])
        assert isinstance(decision, Admit)
        clock.advance(0.1)
        policy.release(decision.ticket, Outcome.DONE)
        policy.observe("a", sample(clock, usage=0.0, capacity=100_000))
    rate = policy.snapshot()["released_tokens_per_s"]
    assert 950 < rate < 1050
    # Now the node is full; a sheddable request of 100 tokens is 10,100 tokens over its ceiling.
    policy.observe("a", sample(clock, usage=0.90, capacity=100_000))
    reject = policy.admit("x", cost(50, 50), Priority.SHEDDABLE, ["a"])
    assert isinstance(reject, Reject) and reject.status == 429
    centre = (0.90 * 100_000 + 100 - 0.80 * 100_000) / rate
    assert 0.8 * centre <= reject.retry_after_s <= 1.2 * centre
