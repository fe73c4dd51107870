"""Fairness between the tenants of one priority band: whose request is served next.

One small interface, two implementations:

- `TokenFairness` (the default) is VTC's virtual token counter (Sheng et al., "Fairness in
  Serving Large Language Models", OSDI '24): each tenant's counter grows with the service it
  receives, `PROMPT_WEIGHT * prompt + OUTPUT_WEIGHT * output` tokens, and the backlogged
  tenant with the smallest counter goes next. A tenant that becomes backlogged has its
  counter lifted to the smallest counter among the tenants already waiting (or to the
  counter last served when none is), so idleness banks no credit; the queue is
  work-conserving, and between two backlogged tenants the service gap stays bounded (VTC
  proves a bound of twice the largest request's weighted size).
  Output is charged at admission as expected and corrected when the request ends.
- `ArrivalOrder` ignores tenants: the band is one FIFO (a plain FCFS queue, for comparison).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class Fairness(Protocol):
    name: str

    def key(self, tenant: str) -> float:
        """Lower is served first (ties: the earlier arrival)."""
        ...

    def backlogged(self, tenant: str, waiting: Iterable[str]) -> None:
        """`tenant` has just got its first waiting request; `waiting`: the others waiting."""
        ...

    def charge(self, tenant: str, prompt: int, output: int) -> None:
        """`tenant` was given a request of `prompt` tokens expected to produce `output`."""
        ...

    def correct(self, tenant: str, output_delta: int) -> None:
        """The request produced `output_delta` more (or fewer) tokens than charged."""
        ...

    def snapshot(self) -> dict[str, float]: ...

    def served(self) -> dict[str, float]:
        """Weighted tokens given to each tenant through this replica (for the others)."""
        ...

    def set_peer_service(self, service: dict[str, float]) -> None:
        """What the other replicas have given each tenant: it counts here too."""
        ...


class TokenFairness:
    """VTC counters by tenant (see the module docstring)."""

    name = "tokens"

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._last = 0.0
        self._served: dict[str, float] = {}
        self._peers: dict[str, float] = {}

    def key(self, tenant: str) -> float:
        return self.counters.get(tenant, self._last) + self._peers.get(tenant, 0.0)

    def backlogged(self, tenant: str, waiting: Iterable[str]) -> None:
        floor = min((self.key(t) for t in waiting if t != tenant), default=self._last)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str, prompt: int, output: int) -> None:
        amount = PROMPT_WEIGHT * prompt + OUTPUT_WEIGHT * output
        value = self.counters.get(tenant, self._last) + amount
        self.counters[tenant] = value
        self._last = value
        self._served[tenant] = self._served.get(tenant, 0.0) + amount

    def correct(self, tenant: str, output_delta: int) -> None:
        if tenant in self.counters:
            self.counters[tenant] = max(0.0, self.counters[tenant] + OUTPUT_WEIGHT * output_delta)
            served = self._served.get(tenant, 0.0) + OUTPUT_WEIGHT * output_delta
            self._served[tenant] = max(0.0, served)

    def snapshot(self) -> dict[str, float]:
        return {t: self.key(t) for t in self.counters}

    def served(self) -> dict[str, float]:
        return dict(self._served)

    def set_peer_service(self, service: dict[str, float]) -> None:
        self._peers = dict(service)


class ArrivalOrder:
    """No fairness: every tenant has the same key, so arrival order decides."""

    name = "fcfs"

    def key(self, tenant: str) -> float:
        return 0.0

    def backlogged(self, tenant: str, waiting: Iterable[str]) -> None:
        return None

    def charge(self, tenant: str, prompt: int, output: int) -> None:
        return None

    def correct(self, tenant: str, output_delta: int) -> None:
        return None

    def snapshot(self) -> dict[str, float]:
        return {}

    def served(self) -> dict[str, float]:
        return {}

    def set_peer_service(self, service: dict[str, float]) -> None:
        return None
