"""The limit algorithms on their own: anti-windup, derivative on measurement, Gradient2."""

from __future__ import annotations

from kvgate.core.limits import GradientLimit, LimitMeasurement, PidLimit

CAP = 10_000


def measure(now: float, usage: float, own: int = 0) -> LimitMeasurement:
    return LimitMeasurement(
        now=now,
        usage=usage,
        capacity_tokens=CAP,
        other_tokens=usage * CAP - own,
        in_flight_tokens=own,
    )


def pid(**kw: float) -> PidLimit:
    gains = {"kp": 0.25, "ki": 2.0, "kd": 0.01, "hysteresis": 0.03} | kw
    return PidLimit(0.80, 0.92, **gains)


def test_integral_does_not_wind_up_during_a_long_overload() -> None:
    limit = pid()
    t = 0.0
    for _ in range(1200):  # a minute at 100 %
        limit.update(measure(t, 1.0))
        t += 0.05
    assert limit.pressure == 1.0
    steps = 0
    while limit.pressure > 0 and steps < 1000:
        limit.update(measure(t, 0.5))
        t += 0.05
        steps += 1
    assert steps * 0.05 <= 0.5  # released within half a second, not a minute
    for _ in range(10):
        limit.update(measure(t, 0.5))
        t += 0.05
        assert limit.pressure == 0.0  # no hidden integral jumping back
    assert not limit.engaged


def test_disengages_only_below_the_hysteresis_band() -> None:
    limit = pid(kp=0.0, kd=0.0)
    t = 0.0
    for _ in range(20):
        limit.update(measure(t, 0.85))
        t += 0.05
    assert limit.engaged and limit.pressure > 0
    for _ in range(200):  # just under the setpoint: drains, yet stays engaged
        limit.update(measure(t, 0.79))
        t += 0.05
    assert limit.engaged and limit.pressure == 0.0
    limit.update(measure(t, 0.76))
    assert not limit.engaged


def test_derivative_acts_on_the_measurement_not_the_error() -> None:
    with_d = pid(kp=0.0, ki=0.0, kd=0.05)
    t = 0.0
    for usage in (0.80, 0.82, 0.84, 0.86):  # rising fast above the setpoint
        with_d.update(measure(t, usage))
        t += 0.05
    assert with_d.pressure > 0  # only D is on: a rising measurement raises pressure
    steady = pid(kp=0.0, ki=0.0, kd=0.05)
    for i in range(10):
        steady.update(measure(i * 0.05, 0.86))
    assert steady.pressure == 0.0  # a constant measurement gives no derivative kick


def test_budget_slides_from_panic_room_to_setpoint_room() -> None:
    limit = pid()
    limit.update(measure(0.0, 0.5, own=2000))
    assert limit.ceiling == 0.92
    assert limit.budget_tokens == 0.92 * CAP - (0.5 * CAP - 2000)
    t = 0.05
    for _ in range(100):
        limit.update(measure(t, 0.9, own=2000))
        t += 0.05
    assert limit.pressure == 1.0 and abs(limit.ceiling - 0.80) < 1e-12


def test_gradient_shrinks_on_excursions_and_grows_back() -> None:
    limit = GradientLimit(0.80, 0.92)
    limit.update(measure(0.0, 0.3, own=3000))
    full = limit.budget_tokens
    assert full is not None and limit.pressure == 0.0
    for i in range(10):
        limit.update(measure(0.05 * (i + 1), 1.0, own=9000))
    assert limit.budget_tokens is not None and limit.budget_tokens < full
    assert limit.pressure > 0
    for i in range(400):
        limit.update(measure(1.0 + 0.05 * i, 0.3, own=0))
    assert limit.pressure == 0.0
