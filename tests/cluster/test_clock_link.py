"""The store's clock as a common base: samples may only look older than they are."""

from __future__ import annotations

import pytest

from kvgate.cluster.samples import ClockLink


def test_unknown_until_the_first_exchange() -> None:
    link = ClockLink()
    assert not link.known
    with pytest.raises(RuntimeError):
        link.to_store(1.0)


def test_round_trip_through_two_processes_never_makes_a_sample_younger() -> None:
    # Replica A's monotonic clock reads 100 when the store's reads 5000; B's reads 7.
    a, b = ClockLink(), ClockLink()
    a.observe(sent_at=100.000, received_at=100.002, store_time=5000.001)
    b.observe(sent_at=7.000, received_at=7.004, store_time=5000.002)
    sampled_on_a = 100.5  # store time 5000.5
    seen_by_b = b.to_local(a.to_store(sampled_on_a))
    true_on_b = 7.0 + (5000.5 - 5000.0)  # B's clock at store time 5000.5 (midpoint model)
    assert seen_by_b <= true_on_b + 1e-9
    assert true_on_b - seen_by_b <= 2 * (0.001 + 0.002) + 1e-9  # at most the round trips


def test_the_shortest_round_trip_wins() -> None:
    link = ClockLink()
    link.observe(0.0, 0.100, 1000.05)  # slow exchange, offset 1000.0 +- 0.05
    link.observe(1.0, 1.002, 1001.001)  # fast one, offset 1000.0 +- 0.001
    link.observe(2.0, 2.080, 1002.09)  # slow again, and skewed
    assert link.uncertainty_s == pytest.approx(0.001)
    assert link.to_store(5.0) == pytest.approx(1005.0 - 0.001)
