"""`seed`: a faithful port of the BEHAVIOUR of the original Go sketch, FLAWS INCLUDED.

This policy exists only as a baseline to compare kvgate against. Do not use it to protect
anything. It reproduces, on purpose, the known flaws of that sketch:

* a rejection rate (integer percent) recomputed only on a 50 ms tick; here the tick is
  driven lazily by the injected clock (the first call after a tick boundary recomputes),
  so a burst arriving between two ticks is judged by the stale rate and admitted whole;
* KV usage *averaged* over the nodes heard from within 1 s (one node at 99 % and one at
  10 % look like 55 %), "last report" being the time the sample was received;
* the piecewise "PID-like" map: >= panic or total waiting > 20 per node -> 100 %;
  > high -> max(10, ratio * 100) %, i.e. a jump to 10 % at the high watermark and no
  hysteresis; otherwise 0 %;
* randomness from the clock's nanoseconds modulo 100, so simultaneous requests draw the
  same number (all pass or all fail together);
* in-flight counted and never compared with any limit; estimated tokens ignored;
  iteration latency ignored;
* when no node is fresh, 50 % of the traffic passes, sent to nodes nobody has heard from;
* no routing: requests go round-robin over the candidates, fresh or not.

One deliberate difference: the gateway's books must not leak, so tickets are reserved and
released exactly once like in every other policy (the sketch's release closure could run
twice). Rejections are 429 with a Retry-After of 3 s +-20 %, as the sketch's text suggests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.core.admission import Reject
from kvgate.core.clock import Clock
from kvgate.core.nodes import NodeState
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

TICK_S = 0.05
REPORT_TIMEOUT_S = 1.0
RETRY_AFTER_S = 3.0


class SeedPolicy(BasePolicy):
    name = "seed"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, lengths=lengths)
        self.rejection_rate = 0  # percent, like the sketch's atomic.Uint32
        self._next_tick = clock.now() + TICK_S
        self._received_at: dict[str, float] = {}
        self._count = 0  # the sketch's currentInFlight: counted, never compared

    def observe(self, node_id: str, sample: NodeSample) -> None:
        # The sketch stamps LastReportTime with its own time.Now() on receipt.
        self._received_at[node_id] = self.clock.now()
        super().observe(node_id, sample)

    def remove_node(self, node_id: str) -> None:
        super().remove_node(node_id)
        self._received_at.pop(node_id, None)

    def _tick(self, now: float) -> None:
        """Run the 50 ms feedback loop if a tick boundary has passed since the last run."""
        if now < self._next_tick:
            return
        missed = int((now - self._next_tick) // TICK_S) + 1
        self._next_tick += missed * TICK_S
        self.rejection_rate = self._recompute(now)

    def _recompute(self, now: float) -> int:
        total_usage = 0.0
        total_waiting = 0
        valid = 0
        for node_id, node in self.nodes.items():
            received = self._received_at.get(node_id)
            if received is None or node.sample is None or now - received >= REPORT_TIMEOUT_S:
                continue
            total_usage += node.sample.kv_usage or 0.0
            total_waiting += node.sample.waiting
            valid += 1
        if valid == 0:
            return 50  # "cluster lost: conservatively block 50 % to prevent breakdown"
        average = total_usage / valid
        high, panic = self.settings.high_watermark, self.settings.panic_watermark
        if average >= panic or total_waiting > valid * 20:
            return 100
        if average > high:
            ratio = (average - high) / (panic - high)
            return int(min(100.0, max(10.0, ratio * 100)))
        return 0

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        self._tick(now)
        rate = self.rejection_rate
        if rate > 0 and int(now * 1e9) % 100 < rate:
            return Reject(
                status=429,
                reason="seed_saturated",
                retry_after_s=jittered(RETRY_AFTER_S, self.rng, MAX_RETRY_AFTER_S),
                message="gpu cluster saturated: dynamic backpressure triggered",
            )
        self._count += 1
        self._rr = (self._rr + 1) % len(candidates)
        return candidates[self._rr]

    def _on_observe(self, now: float, node: NodeState) -> None:
        self._tick(now)

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        self._tick(now)
        p = self.rejection_rate / 100
        return {
            "budget_tokens": None,
            "in_flight_tokens": self.in_flight_tokens,
            "setpoint": None,
            "shed_probability": {"critical": p, "standard": p, "sheddable": p},
            "rejection_rate_percent": self.rejection_rate,
        }
