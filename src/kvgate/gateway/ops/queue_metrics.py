"""The queue's metrics (`kvgate_queue_*`, `kvgate_client_deadline_seconds`), from the flow
controller's snapshot: what waits now, per priority and per tenant, what became of it, and
the deadlines learned from clients that leave."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def number(value: Any) -> float | None:
    """A snapshot's value as a metric's: finite numbers only (not bools)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def queue_metrics(queue: Mapping[str, Any]) -> Iterator[Metric]:
    """`kvgate_queue_*`: what waits now, per priority and per tenant, and what became of it."""
    waiting = GaugeMetricFamily(
        "kvgate_queue_waiting", "Requests waiting in the gateway's queue.", labels=["priority"]
    )
    tokens = GaugeMetricFamily(
        "kvgate_queue_tokens",
        "KV tokens (prompt + max_tokens) of the requests waiting.",
        labels=["priority"],
    )
    oldest = GaugeMetricFamily(
        "kvgate_queue_oldest_seconds",
        "How long the oldest waiting request has waited.",
        labels=["priority"],
    )
    bands = queue.get("bands")
    if isinstance(bands, Mapping):
        for priority, band in bands.items():
            if isinstance(band, Mapping):
                waiting.add_metric([str(priority)], number(band.get("waiting")) or 0.0)
                tokens.add_metric([str(priority)], number(band.get("tokens")) or 0.0)
                oldest.add_metric([str(priority)], number(band.get("oldest_s")) or 0.0)
    tenants = GaugeMetricFamily(
        "kvgate_queue_tenant_waiting", "Requests waiting, per tenant.", labels=["tenant"]
    )
    for tenant, count in (queue.get("tenants") or {}).items():
        tenants.add_metric([str(tenant) or "-"], number(count) or 0.0)
    events = CounterMetricFamily(
        "kvgate_queue_events",
        "Requests queued, started after waiting, cancelled while waiting, or refused"
        " (event `refused:<reason>`).",
        labels=["event"],
    )
    for event, count in (queue.get("counters") or {}).items():
        events.add_metric([str(event)], number(count) or 0.0)
    yield waiting
    yield tokens
    yield oldest
    yield tenants
    yield events
    yield _deadlines(queue.get("patience"))


def _deadlines(patience: Any) -> Metric:
    """`kvgate_client_deadline_seconds`: the deadline learned from each tenant's clients
    that leave (`kvgate.core.flow.patience`); a tenant whose clients show none is absent."""
    family = GaugeMetricFamily(
        "kvgate_client_deadline_seconds",
        "Seconds after which a tenant's clients leave, learned from those that left (absent"
        " while they show no deadline); their requests wait at most this less their answer.",
        labels=["tenant"],
    )
    tenants = patience.get("tenants") if isinstance(patience, Mapping) else None
    for tenant, learned in (tenants or {}).items():
        deadline = number(learned.get("deadline_s")) if isinstance(learned, Mapping) else None
        if deadline is not None:
            family.add_metric([str(tenant) or "-"], deadline)
    return family
