"""What the scraper knows of each node's polls: their counts, latencies and failures, for
`/admin/state`, Prometheus and the dashboard (`NodeStats`), and how a failed scrape is told
(`describe`, never a secret)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from kvgate.adapters.base import MetricsParseError
from kvgate.core.signals import NodeSample
from kvgate.gateway.engines.scrape_http import ScrapeError


@dataclass(slots=True)
class NodeStats:
    """What the scraper knows about one node, for `/admin/state` and Prometheus."""

    node_id: str
    engine: str
    metrics_url: str  # the page polled now: the full one, or the narrowed one once checked
    page: Literal["full", "narrowed"] = "full"
    #: Why a node that could be polled on the narrowed page is not (None: it is, or it
    #: cannot be: no narrowed page for its dialect).
    page_note: str | None = None
    scrapes_total: int = 0
    #: GETs started beside a poll that had been out `stale_after_s` (see `scrape_once`).
    hedges_total: int = 0
    failures_total: int = 0
    consecutive_failures: int = 0
    last_latency_s: float | None = None
    last_success_at: float | None = None
    last_error: str | None = None
    last_sample: NodeSample | None = None
    up: bool | None = None  # None: not scraped yet
    #: When the poll in flight was sent (None: none is).
    in_flight_since: float | None = None
    #: From one poll's start to the next's, as backed off after the last poll.
    period_s: float = 0.0
    slow: bool = False  # polled back to back because its page is slow
    # When its page last turned slow at INFO (None: never), whether the present slow spell
    # was told at INFO, and the slow spells told at DEBUG since.
    slow_told_at: float | None = field(default=None, repr=False)
    slow_told: bool = field(default=False, repr=False)
    slow_spells_untold: int = field(default=0, repr=False)
    _latency_observations: deque[float] = field(
        default_factory=lambda: deque(maxlen=4096), repr=False
    )

    def as_dict(self, now: float) -> dict[str, Any]:
        sample = self.last_sample
        return {
            "node_id": self.node_id,
            "engine": self.engine,
            "metrics_url": self.metrics_url,
            "page": self.page,
            "page_note": self.page_note,
            "up": self.up,
            "scrapes_total": self.scrapes_total,
            "hedges_total": self.hedges_total,
            "failures_total": self.failures_total,
            "consecutive_failures": self.consecutive_failures,
            "last_latency_s": self.last_latency_s,
            "in_flight_s": (
                None if self.in_flight_since is None else max(0.0, now - self.in_flight_since)
            ),
            "period_s": self.period_s,
            "slow": self.slow,
            "last_error": self.last_error,
            "last_success_age_s": (
                None if self.last_success_at is None else max(0.0, now - self.last_success_at)
            ),
            "last_sample": None if sample is None else sample.as_dict(),
        }

    def drain_latencies(self) -> list[float]:
        """Scrape latencies observed since the last call (the newest 4096 at most), to feed
        a Prometheus histogram at collection time."""
        out = list(self._latency_observations)
        self._latency_observations.clear()
        return out

    def _observe_latency(self, latency: float) -> None:
        self.last_latency_s = latency
        self._latency_observations.append(latency)


def describe(exc: BaseException, timeout: float) -> str:
    """A short, secret-free description of why a scrape failed."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s (hung)"
    if isinstance(exc, ScrapeError | MetricsParseError):
        return str(exc)[:200]
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:200]
