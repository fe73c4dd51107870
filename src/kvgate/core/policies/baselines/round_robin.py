"""`round-robin`: admit everything and send each request to the next candidate in turn
(what a plain load balancer such as nginx does in front of engines).

It reserves and releases like every other policy, so its books return to zero.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.core.admission import Reject
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest


class RoundRobinPolicy(BasePolicy):
    name = "round-robin"

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        self._rr = (self._rr + 1) % len(candidates)
        return candidates[self._rr]
