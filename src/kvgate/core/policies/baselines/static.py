"""Static baselines: what a conventional API gateway does (`static-qps`, `static-concurrency`).

Both ignore the engines' state entirely (they route like `none`: fewest live tickets
among the candidates), which is the point of comparing against them: a fixed quota is
either too low for short requests or far too high for long-context ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.core.admission import Reject
from kvgate.core.clock import Clock
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered
from kvgate.core.settings import AdmissionSettings


@dataclass(frozen=True, slots=True)
class BaselineOptions:
    """The static baselines' quotas: `static-qps`'s token bucket (`qps` requests per
    second, `burst` deep) and `static-concurrency`'s cap (`concurrency` in flight)."""

    qps: float = 50.0
    burst: int = 50
    concurrency: int = 32

    def __post_init__(self) -> None:
        for name in ("qps", "burst", "concurrency"):
            if not getattr(self, name) > 0:
                raise ValueError(f"baseline {name} must be positive, not {getattr(self, name)}")


class StaticQpsPolicy(BasePolicy):
    """A token bucket: `options.qps` requests per second, bursts up to `options.burst`."""

    name = "static-qps"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        options: BaselineOptions,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, lengths=lengths)
        self._rate = options.qps
        self._depth = float(options.burst)
        self._tokens = self._depth
        self._filled_at = clock.now()

    def _refill(self, now: float) -> None:
        elapsed = now - self._filled_at
        if elapsed > 0:
            self._tokens = min(self._depth, self._tokens + elapsed * self._rate)
            self._filled_at = now

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        self._refill(now)
        if self._tokens < 1.0:
            wait = (1.0 - self._tokens) / self._rate
            centre = min(max(1.0, wait), MAX_RETRY_AFTER_S)
            return Reject(
                status=429,
                reason="qps_limit",
                retry_after_s=jittered(centre, self.rng, MAX_RETRY_AFTER_S),
                message=f"More than {self._rate:g} requests per second; retry later.",
            )
        self._tokens -= 1.0
        return self.least_loaded(candidates)


class StaticConcurrencyPolicy(BasePolicy):
    """At most `options.concurrency` requests in flight through this gateway."""

    name = "static-concurrency"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        options: BaselineOptions,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, lengths=lengths)
        self._cap = options.concurrency

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        if self.in_flight_requests >= self._cap:
            return self.reject_shed(
                "concurrency_limit",
                f"{self._cap} requests already in flight; retry later.",
                now,
                self.footprint(request, expected),
            )
        return self.least_loaded(candidates)
