"""The margin controller on its own: zero while the plan holds, P then I on an overshoot,
a bounded integral, and a fade with the configured half-life once the overshoot is gone."""

from __future__ import annotations

import pytest

from kvgate.core.plan.margin import HALFLIFE_S, KI, KP, MAX_DT_S, MarginController

TARGET = 0.92
SPAN = 0.12
DT = 0.05


def run(margin: MarginController, usage: float, seconds: float, start: float) -> float:
    """Feed `usage` every DT for `seconds` from `start`; returns the time reached."""
    t = start
    for _ in range(round(seconds / DT)):
        margin.update(t, usage, TARGET)
        t += DT
    return t


def test_no_margin_while_measured_usage_stays_at_or_below_the_target() -> None:
    margin = MarginController(SPAN)
    t = 0.0
    for usage in (0.0, 0.5, 0.85, 0.91, TARGET, 0.3):
        assert margin.update(t, usage, TARGET) == 0.0
        t += DT
    assert margin.margin == 0.0


def test_an_overshoot_takes_its_size_at_once_then_grows_while_it_lasts() -> None:
    margin = MarginController(SPAN)
    margin.update(0.0, 0.5, TARGET)
    first = margin.update(DT, 0.95, TARGET)  # P on the first evidence, I begins
    assert abs(first - (KP * 0.03 + KI * 0.03 * DT)) < 1e-12
    second = margin.update(2 * DT, 0.95, TARGET)
    assert abs(second - (KP * 0.03 + 2 * KI * 0.03 * DT)) < 1e-12
    assert second > first


def test_the_margin_never_passes_its_span_and_does_not_wind_up() -> None:
    margin = MarginController(SPAN)
    t = run(margin, 1.0, 60.0, 0.0)  # a minute at 100 %
    assert margin.margin == SPAN
    t = run(margin, 0.5, HALFLIFE_S, t)
    # One half-life later it has halved from at most the span: the integral was capped.
    assert margin.margin <= SPAN / 2 * 1.02
    run(margin, 0.5, 20 * HALFLIFE_S, t)
    assert margin.margin == 0.0  # faded out completely, no hidden integral left


def test_it_fades_with_its_half_life_once_the_overshoot_is_gone() -> None:
    margin = MarginController(SPAN)
    t = run(margin, 0.96, 0.5, 0.0)
    held = margin.update(t, 0.5, TARGET)  # the P part goes at once, the I part remains
    assert 0 < held < SPAN
    t = run(margin, 0.5, HALFLIFE_S, t + DT)
    assert abs(margin.margin - held / 2) < held * 0.02


def test_a_long_gap_between_samples_counts_as_at_most_max_dt() -> None:
    margin = MarginController(SPAN)
    margin.update(0.0, 0.93, TARGET)
    after_gap = margin.update(60.0, 0.93, TARGET)
    assert abs(after_gap - (KP * 0.01 + KI * 0.01 * MAX_DT_S)) < 1e-12
    assert margin.update(59.0, 0.93, TARGET) >= after_gap  # a clock going back is no time


def test_the_span_must_be_positive() -> None:
    with pytest.raises(ValueError):
        MarginController(0.0)
