"""kvgate's queue as a live benchmark sees it from outside: `/admin/state` and `/metrics`.

A request that cannot start at once waits in the gateway, so how much of a run was
scheduled by waiting, and for how long, is part of what a run measured. The load generator
reads three things the gateway exposes:

- `policy.queue.waiting` of `/admin/state` at every step: how many wait now (the time
  series `queued`, the same one the virtual runs record);
- `policy.queue.counters` before and after the run: requests `queued`, started after
  waiting (`admitted_after_wait`) and gone while waiting (`cancelled`);
- the histogram `kvgate_queue_wait_seconds` of `/metrics` before and after the run: every
  wait, however it ended (started, refused at its bound, or the client left), summed over
  priorities; its mean is exact (sum / count), its 90th percentile interpolated within the
  bucket it falls in, as Prometheus's `histogram_quantile` does.

The differences between the two readings are the run's own, whatever the gateway served
before it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUEUE_WAIT = "kvgate_queue_wait_seconds"
WAIT_QUANTILE = 0.9


@dataclass(frozen=True)
class WaitHistogram:
    """`kvgate_queue_wait_seconds` summed over its label sets."""

    buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), ascending
    count: float = 0.0
    total_s: float = 0.0

    def since(self, earlier: WaitHistogram) -> WaitHistogram:
        """The observations made after `earlier` was read (same buckets, or none yet)."""
        before = dict(earlier.buckets)
        return WaitHistogram(
            tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
            self.count - earlier.count,
            self.total_s - earlier.total_s,
        )

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count > 0 else math.nan

    def quantile(self, q: float) -> float:
        """The `q` quantile, linear within its bucket; the highest finite bound when it
        falls in the `+Inf` bucket; NaN without observations."""
        if self.count <= 0 or not self.buckets:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = le, cumulative
        return lower


def wait_histogram(metrics_text: str) -> WaitHistogram:
    """`kvgate_queue_wait_seconds` from a `/metrics` page (empty if the page has none)."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != QUEUE_WAIT:
            continue
        for sample in family.samples:
            if sample.name == QUEUE_WAIT + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == QUEUE_WAIT + "_count":
                count += sample.value
            elif sample.name == QUEUE_WAIT + "_sum":
                total += sample.value
    return WaitHistogram(tuple(sorted(buckets.items())), count, total)


def _queue(state: Mapping[str, Any] | None) -> Mapping[str, Any]:
    policy = (state or {}).get("policy")
    queue = policy.get("queue") if isinstance(policy, Mapping) else None
    return queue if isinstance(queue, Mapping) else {}


def waiting_now(state: Mapping[str, Any] | None) -> float:
    """Requests waiting in the gateway's queue (NaN when the state has no queue)."""
    waiting = _queue(state).get("waiting")
    return float(waiting) if isinstance(waiting, int | float) else math.nan


def _counter(state: Mapping[str, Any] | None, name: str) -> float:
    counters = _queue(state).get("counters")
    value = counters.get(name) if isinstance(counters, Mapping) else None
    return float(value) if isinstance(value, int | float) else 0.0


def queue_summary(
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    waits: WaitHistogram,
    peak_waiting: float,
) -> dict[str, float]:
    """What the run put through the gateway's queue, from the states read before and after
    it and the run's own `waits` (`WaitHistogram.since`)."""

    def delta(name: str) -> float:
        return _counter(after, name) - _counter(before, name)

    return {
        "peak_waiting": peak_waiting,
        "queued": delta("queued"),
        "started_after_wait": delta("admitted_after_wait"),
        "left_while_waiting": delta("cancelled"),
        "waits": waits.count,
        "wait_mean_s": waits.mean_s,
        "wait_p90_s": waits.quantile(WAIT_QUANTILE),
    }
