"""Limit algorithms: one small interface, the PID controller as its implementation.

In the style of Netflix concurrency-limits, a limit algorithm is fed a measurement and
exposes a limit; the admission policy enforces it. The adaptive policy runs one limit per
node (never one for an average of nodes). The limit has two faces: `pressure` (0-1), from
which the policy derives per-priority shedding probabilities, and `budget_tokens`, the KV
tokens this gateway's tickets may hold on the node, which is a dynamic ceiling sliding from
the panic watermark (pressure 0) down to the setpoint (pressure 1).

Why PID and not a gradient (Gradient2) limit
--------------------------------------------
The controlled quantity is predicted KV usage, a fraction with a *known* target (the high
watermark), and the plant is nearly static and linear: usage ~= (tokens held) / capacity,
with no queueing-delay non-linearity between what we admit and what we measure (our own
reservations make the response immediate). That is the textbook case for setpoint tracking
with a PI(D) loop. A gradient limit is built for the opposite case: the target (no-load
latency) is unknown and must be inferred from the ratio of long- to short-window latency,
and it moves the limit multiplicatively, which on a usage signal with a fixed target only
adds a second learned quantity and drift. Latency still matters here, but as a *state*
(the thrashing detector takes a node out of rotation) rather than as the control variable.

Simulator evidence (`benchmarks/controller_choice/results.md`: 2 simulated engines of
4,096 KV tokens, 180 s x 3 seeds per cell, loads 1-3x the sustainable rate): Gradient2
over-sheds badly - SLO attainment 0.42 / 0.26 / 0.17 at 1 / 2 / 3x against 0.98 / 0.92 /
0.90 for PID - because every excursion above the target cuts the budget multiplicatively
and it only grows back additively. PID is within noise of *no feedback at all* (the
per-node ceilings alone) on goodput and SLO in every regime, with slightly fewer
preemptions when 30 % of the load is invisible to the gateway (4.3 / 4.7 per run at 2 / 3x
against 4.7 / 5.7). Said plainly: the protection comes from the reservations and the
ceilings; this loop only shapes where, between the watermarks, shedding starts, and it
must never make things worse - which is what the gains below are tuned for (no dither:
see `tests/core/test_adaptive.py::test_watermark_crossing_does_not_flap`).

The loop, in `PidLimit.update`:
  * error       e = (y - setpoint) / (panic - setpoint)       (y: node's predicted usage)
  * proportional P = kp * e
  * integral    I += ki * e * dt, clamped to [0, 1], and frozen while the output is
                saturated at 1 and the error still pushes up (conditional integration).
                Both are anti-windup: a long overload leaves no debt to unwind, and
                shedding stops within a few samples once usage is back under target
  * derivative  D = kd * d(y_f)/dt / (panic - setpoint), on the filtered *measurement*
                rather than on the error, so a setpoint change does not kick the output
  * pressure    = clamp(P + I + D, 0, 1)
Hysteresis: the loop engages when y reaches the setpoint and disengages (pressure forced to
zero, integral cleared) only once y has fallen `hysteresis` below it *and* the integral has
drained, so the shedding probability glides instead of jumping between 0 and 100 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class LimitMeasurement:
    """What the policy tells a node's limit at each new sample of that node."""

    now: float
    usage: float  # the node's predicted KV usage (reported + unreflected reservations)
    capacity_tokens: float  # the node's KV capacity
    other_tokens: float  # predicted tokens not held by this gateway's tickets
    in_flight_tokens: int  # this gateway's full reservations on the node


class TokenLimit(Protocol):
    name: str

    def update(self, m: LimitMeasurement) -> None: ...

    @property
    def pressure(self) -> float:
        """0 (no shedding) .. 1 (shed everything the priorities allow)."""
        ...

    @property
    def budget_tokens(self) -> float | None:
        """Tokens this gateway's tickets may hold; None before the first measurement."""
        ...

    @property
    def setpoint(self) -> float: ...

    @property
    def ceiling(self) -> float:
        """Usage non-critical work may not push the node past: panic (0) .. setpoint (1)."""
        ...


class PidLimit:
    """Positional PID with clamped, conditional integration (see the module docstring)."""

    name = "pid"

    def __init__(
        self,
        setpoint: float,
        panic: float,
        *,
        kp: float,
        ki: float,
        kd: float,
        hysteresis: float,
        derivative_smoothing: float = 0.2,
        max_dt_s: float = 1.0,
    ) -> None:
        if not 0 < setpoint < panic:
            raise ValueError("the setpoint must be positive and below the panic watermark")
        self._setpoint = setpoint
        self._panic = panic
        self._span = panic - setpoint
        self.kp, self.ki, self.kd = kp, ki, kd
        self.hysteresis = hysteresis
        self._alpha = derivative_smoothing
        self._max_dt = max_dt_s
        self._integral = 0.0
        self._pressure = 0.0
        self._engaged = False
        self._y_filtered: float | None = None
        self._last_at: float | None = None
        self._budget: float | None = None

    @property
    def pressure(self) -> float:
        return self._pressure

    @property
    def budget_tokens(self) -> float | None:
        return self._budget

    @property
    def setpoint(self) -> float:
        return self._setpoint

    @property
    def ceiling(self) -> float:
        return self._panic - self._span * self._pressure

    @property
    def engaged(self) -> bool:
        return self._engaged

    def update(self, m: LimitMeasurement) -> None:
        dt = 0.0 if self._last_at is None else min(self._max_dt, max(0.0, m.now - self._last_at))
        self._last_at = m.now
        y = m.usage
        previous = self._y_filtered
        y_f = y if previous is None else previous + self._alpha * (y - previous)
        self._y_filtered = y_f
        slope = 0.0 if previous is None or dt <= 0 else (y_f - previous) / dt

        error = (y - self._setpoint) / self._span
        if not self._engaged and y >= self._setpoint:
            self._engaged = True
        if self._engaged:
            # Conditional integration: never push further into upper saturation. Downwards
            # the integral keeps draining (clamped at 0), so it cannot linger, hidden
            # under a negative P term, and jump back when the error turns.
            if not (self._pressure >= 1.0 and error > 0):
                self._integral = min(1.0, max(0.0, self._integral + self.ki * error * dt))
            raw = self.kp * error + self._integral + self.kd * slope / self._span
            self._pressure = min(1.0, max(0.0, raw))
            if y < self._setpoint - self.hysteresis and self._integral <= 0.0:
                self._engaged = False
        if not self._engaged:
            self._pressure = 0.0
            self._integral = 0.0
        self._budget = max(0.0, m.capacity_tokens * self.ceiling - m.other_tokens)


class GradientLimit:
    """Netflix Gradient2, transposed from latency to KV usage (kept for comparison).

    Each update: `gradient = clamp(setpoint / usage, 0.5, 1)`; the new budget is
    `budget * gradient + growth` (growth: `growth_fraction` of capacity while the gateway
    uses at least half its budget, Netflix's app-limited guard, or while usage is under the
    setpoint), smoothed by `smoothing`, clamped to [0, room to panic]. The ceiling is the
    usage the budget allows and the pressure its distance below panic, so the policy
    treats both limits alike.
    """

    name = "gradient"

    def __init__(
        self,
        setpoint: float,
        panic: float,
        *,
        smoothing: float = 0.2,
        growth_fraction: float = 0.02,
    ) -> None:
        if not 0 < setpoint < panic:
            raise ValueError("the setpoint must be positive and below the panic watermark")
        self._setpoint = setpoint
        self._panic = panic
        self._span = panic - setpoint
        self._smoothing = smoothing
        self._growth = growth_fraction
        self._budget: float | None = None
        self._ceiling = panic

    @property
    def pressure(self) -> float:
        return (self._panic - self._ceiling) / self._span

    @property
    def budget_tokens(self) -> float | None:
        return self._budget

    @property
    def setpoint(self) -> float:
        return self._setpoint

    @property
    def ceiling(self) -> float:
        return self._ceiling

    def update(self, m: LimitMeasurement) -> None:
        capacity = m.capacity_tokens
        room = max(0.0, self._panic * capacity - m.other_tokens)
        budget = room if self._budget is None else self._budget
        gradient = 1.0 if m.usage <= 0 else min(1.0, max(0.5, self._setpoint / m.usage))
        # Netflix grows only while the limit is in use (app-limited guard). Here shedding
        # follows the budget, so an unused budget must still grow back while usage is under
        # the setpoint, or a shrunken budget would shed everything forever.
        grow = m.in_flight_tokens >= budget / 2 or m.usage < self._setpoint
        growth = self._growth * capacity if grow else 0.0
        target = budget * gradient + growth
        budget = budget + self._smoothing * (target - budget)
        self._budget = min(room, max(0.0, budget))
        ceiling = (self._budget + m.other_tokens) / capacity if capacity > 0 else self._panic
        self._ceiling = min(self._panic, max(self._setpoint, ceiling))
