"""`none`: admit everything (the "no admission control" baseline).

It still routes (fewest live tickets among the candidates, ties round-robin) and still
reserves and releases exactly like every other policy, so its snapshot shows what the
cluster's predicted usage would be and its books return to zero.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.core.admission import Reject
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest


class NonePolicy(BasePolicy):
    name = "none"

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        return self.least_loaded(candidates)
