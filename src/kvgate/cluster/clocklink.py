"""The store's clock as a common time base: how samples cross from one replica to another.

A sample's `sampled_at` is on the monotonic clock of the process that scraped it, which
means nothing to another process, let alone another host. Every sync tick brings back the
store's own time (Redis `TIME`) and is bracketed by two readings of the local clock, so
`offset = store_time - midpoint` maps local time to store time with an error of at most
half the round trip. A sample travels in store time and is mapped back by each reader.

The link keeps the best (shortest round trip) of its recent estimates, and errs on the
safe side: both directions subtract the uncertainty, so a sample can only look older than
it is, never younger (an older sample reflects fewer requests, so the core over-counts,
never under-counts). On loopback the round trip is a few hundred microseconds.
"""

from __future__ import annotations

from collections import deque

_WINDOW = 16


class ClockLink:
    def __init__(self) -> None:
        self._estimates: deque[tuple[float, float]] = deque(maxlen=_WINDOW)  # (half-rtt, off)
        self._offset: float | None = None
        self._uncertainty = 0.0

    @property
    def known(self) -> bool:
        return self._offset is not None

    @property
    def uncertainty_s(self) -> float:
        return self._uncertainty

    def observe(self, sent_at: float, received_at: float, store_time: float) -> None:
        """One exchange: sent and answered at these local instants, run at `store_time`."""
        half = max(0.0, received_at - sent_at) / 2
        self._estimates.append((half, store_time - (sent_at + half)))
        self._uncertainty, self._offset = min(self._estimates)

    def to_store(self, local: float) -> float:
        if self._offset is None:
            raise RuntimeError("no exchange yet: the store's clock is unknown")
        return local + self._offset - self._uncertainty

    def to_local(self, store: float) -> float:
        if self._offset is None:
            raise RuntimeError("no exchange yet: the store's clock is unknown")
        return store - self._offset - self._uncertainty
