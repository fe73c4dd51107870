"""Small online estimators driven by the injected clock (no timers, no threads)."""

from __future__ import annotations

import math
from collections import deque


class DecayingRate:
    """Events-per-second estimate: an exponentially decayed sum of amounts, divided by tau.

    Each event adds `amount / tau` and the estimate decays with time constant
    `tau = halflife / ln 2`. For a steady stream of rate r this converges to r, and it
    decays towards zero when nothing happens, which is what a "capacity freed per second"
    measurement should do. O(1) per event, one `exp` per update.
    """

    __slots__ = ("_at", "_tau", "_value")

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError("halflife must be positive")
        self._tau = halflife_s / math.log(2)
        self._value = 0.0
        self._at: float | None = None

    def add(self, now: float, amount: float) -> None:
        self._value = self.value(now) + amount / self._tau
        self._at = now if self._at is None else max(self._at, now)

    def value(self, now: float) -> float:
        if self._at is None:
            return 0.0
        elapsed = now - self._at
        if elapsed <= 0:
            return self._value
        return self._value * math.exp(-elapsed / self._tau)


class Ewma:
    """Time-aware EWMA: the weight of a new value depends on the time since the last one."""

    __slots__ = ("_at", "_halflife", "count", "value")

    def __init__(self, halflife_s: float) -> None:
        if halflife_s <= 0:
            raise ValueError("halflife must be positive")
        self._halflife = halflife_s
        self.value: float | None = None
        self._at: float | None = None
        self.count = 0

    def update(self, now: float, x: float) -> float:
        if self.value is None or self._at is None:
            self.value = x
        else:
            dt = max(0.0, now - self._at)
            alpha = 1.0 - 0.5 ** (dt / self._halflife) if dt > 0 else 0.0
            # A burst of samples at one instant still moves the average a little.
            alpha = max(alpha, 1e-3)
            self.value += alpha * (x - self.value)
        self._at = now
        self.count += 1
        return self.value


class DecayingMean:
    """Weighted mean of observations, the older fading with a half-life: a value given
    with weight `w` counts as `w` observations of it (a window's mean as the observations
    it rests on). Two `DecayingRate`s, of the weighted values and of the weights, whose
    ratio it is. `windows`: how many values were added."""

    __slots__ = ("_at", "_sum", "_weight", "windows")

    def __init__(self, halflife_s: float) -> None:
        self._sum = DecayingRate(halflife_s)
        self._weight = DecayingRate(halflife_s)
        self._at = 0.0
        self.windows = 0

    def add(self, now: float, value: float, weight: float = 1.0) -> None:
        self._sum.add(now, value * weight)
        self._weight.add(now, weight)
        self._at = max(self._at, now) if self.windows else now
        self.windows += 1

    @property
    def value(self) -> float | None:
        weight = self._weight.value(self._at)
        return self._sum.value(self._at) / weight if weight > 0 else None


class RecentMin:
    """The least value added within the last `span_s` (a monotonic queue: O(1) amortised)."""

    __slots__ = ("_span", "_values")

    def __init__(self, span_s: float) -> None:
        self._span = span_s
        self._values: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        values = self._values
        while values and values[-1][1] >= value:
            values.pop()
        values.append((now, value))

    def value(self, now: float) -> float | None:
        values = self._values
        while values and values[0][0] < now - self._span:
            values.popleft()
        return values[0][1] if values else None
