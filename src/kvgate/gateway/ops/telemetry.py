"""kvgate's own Prometheus metrics and its one-line-per-request access log.

Hot-path cost matters (the proxy's budget is a quarter of a millisecond of CPU per
request), so counters are plain dict increments exposed by a custom collector at scrape
time, histogram children are looked up once and cached, and everything derived from the
admission core or the scraper (node usage, the queue, scrape latency) is read from their
snapshots only when `/metrics` is scraped.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvgate.core.nodes import STATES
from kvgate.core.plan.ceiling import REASONS
from kvgate.gateway.ops.queue_metrics import number as _number
from kvgate.gateway.ops.queue_metrics import queue_metrics
from kvgate.gateway.ops.tenants import TenantTally

access_logger = logging.getLogger("kvgate.access")

# Buckets from 1 ms to 10 min: time to first byte ranges from a cached reply to a long queue.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
# A scrape takes a few ms on a quiet engine and seconds on a busy one (up to the hang
# bound, 5 x stale_after_s).
_SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.5, 1.0, 2.5, 5.0)
# Cancellation should take about a millisecond; anything above 50 ms is a bug.
_CANCEL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_RETRY_AFTER_BUCKETS = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 30.0, 60.0)

SnapshotFn = Callable[[], Mapping[str, Any]]


class GatewayMetrics:
    """Every metric of one gateway instance, in its own registry (tests run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.in_flight = 0
        self.requests: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.upstream_errors: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.cancellations: defaultdict[str, int] = defaultdict(int)
        self.admissions: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.tenants = TenantTally()  # refusals and served tokens per tenant
        self.retries = 0
        # Streams whose client left mid-stream: the SSE data events relayed to those clients
        # before they left (they may not have read them all), and any received from the
        # upstream after the disconnect was noticed (the relay stops reading at once: 0).
        self.client_gone_streams = 0
        self.client_gone_events = 0
        self.events_after_client_gone = 0
        self._ttfb = LabelledHistogram(
            "kvgate_time_to_first_byte_seconds",
            "From request arrival to the first response byte sent to the client.",
            _LATENCY_BUCKETS,
            "route",
        )
        self._duration = LabelledHistogram(
            "kvgate_request_duration_seconds",
            "From request arrival to the end of the response, however it ended.",
            _LATENCY_BUCKETS,
            "route",
        )
        self._cancel = Histogram(
            "kvgate_cancel_propagation_seconds",
            "From noticing the client disconnect to closing the upstream request.",
            buckets=_CANCEL_BUCKETS,
            registry=self.registry,
        )
        self._retry_after = Histogram(
            "kvgate_retry_after_seconds",
            "Retry-After handed out with each 429/503 refusal (before rounding up).",
            buckets=_RETRY_AFTER_BUCKETS,
            registry=self.registry,
        )
        self._queue_wait = LabelledHistogram(
            "kvgate_queue_wait_seconds",
            "Time requests spent waiting in the gateway's queue, however the wait ended.",
            _LATENCY_BUCKETS,
            "priority",
        )
        self.retry_after_count = 0
        self.retry_after_sum_s = 0.0
        self.policy_snapshot: SnapshotFn | None = None
        self.scraper_stats: SnapshotFn | None = None
        #: `Scraper.stats()`: per-node latencies drained into a histogram at scrape time.
        self.scraper_node_stats: Callable[[], Mapping[str, Any]] | None = None
        self._scrape = LabelledHistogram(
            "kvgate_scrape_duration_seconds",
            "Duration of each scrape of an engine's metrics page.",
            _SCRAPE_BUCKETS,
            "node",
        )
        self.registry.register(_SnapshotCollector(self))

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self._ttfb.observe(route, seconds)

    def observe_duration(self, route: str, seconds: float) -> None:
        self._duration.observe(route, seconds)

    def observe_cancel(self, stage: str, seconds: float) -> None:
        self.cancellations[stage] += 1
        self._cancel.observe(seconds)

    def observe_client_gone_stream(self, relayed: int, after_disconnect: int) -> None:
        """A stream ended by its client's disconnect, after `relayed` data events."""
        self.client_gone_streams += 1
        self.client_gone_events += relayed
        self.events_after_client_gone += after_disconnect

    def observe_queue_wait(self, priority: str, seconds: float) -> None:
        self._queue_wait.observe(priority, seconds)

    def observe_retry_after(self, seconds: float) -> None:
        self.retry_after_count += 1
        self.retry_after_sum_s += seconds
        self._retry_after.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def counters(self) -> dict[str, Any]:
        """Plain JSON counters for `/admin/state`."""
        return {
            "in_flight": self.in_flight,
            "requests": {"|".join(k): v for k, v in self.requests.items()},
            "upstream_errors": {"|".join(k): v for k, v in self.upstream_errors.items()},
            "cancellations": dict(self.cancellations),
            "admissions": {"|".join(k): v for k, v in self.admissions.items()},
            "retries": self.retries,
            "client_gone_streams": self.client_gone_streams,
            "client_gone_events": self.client_gone_events,
            "events_after_client_gone": self.events_after_client_gone,
            "retry_after_count": self.retry_after_count,
            "retry_after_sum_s": round(self.retry_after_sum_s, 3),
        }


class LabelledHistogram:
    """A histogram with one label (route, node), its counts kept as plain lists.

    The route histograms sit on the hot path, two observations per request: a bisect and
    two additions, ~0.5 µs per observation, against 1.5-2.3 µs for a child of
    prometheus_client's `Histogram`, which takes a lock and walks its buckets (measured side
    by side, 3 rounds). The families are built when `/metrics` is scraped.
    """

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], label: str
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.buckets = buckets
        self.label = label
        # label value -> [count per bucket (the last is +Inf), sum of the observed values]
        self._by_value: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, value: str, seconds: float) -> None:
        entry = self._by_value.get(value)
        if entry is None:
            entry = self._by_value[value] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, seconds)] += 1
        entry[1][0] += seconds

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        bounds = [str(b) for b in self.buckets] + ["+Inf"]
        for value, (counts, total) in sorted(self._by_value.items()):
            cumulative = list(itertools.accumulate(counts))
            family.add_metric(
                [value], list(zip(bounds, cumulative, strict=True)), sum_value=total[0]
            )
        return family


class _SnapshotCollector(Collector):
    """Turns the gateway's counters and the policy/scraper snapshots into metrics on scrape."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield _gauge("kvgate_requests_in_flight", "Requests being served now.", m.in_flight)
        yield _counter(
            "kvgate_requests",
            "Requests answered, by route, status and backend.",
            ["route", "status", "backend"],
            m.requests,
        )
        yield _counter(
            "kvgate_upstream_errors",
            "Upstream failures, by backend and kind (connect, reset, timeout, status).",
            ["backend", "kind"],
            m.upstream_errors,
        )
        yield _counter(
            "kvgate_cancellations_propagated",
            "Client disconnects carried upstream, by the stage the request was in.",
            ["stage"],
            {(k,): v for k, v in m.cancellations.items()},
        )
        yield _counter(
            "kvgate_admissions",
            "Admission decisions, by decision, priority and reason.",
            ["decision", "priority", "reason"],
            m.admissions,
        )
        retries = CounterMetricFamily(
            "kvgate_upstream_retries", "Requests retried on another backend before any byte."
        )
        retries.add_metric([], m.retries)
        yield retries
        yield from _client_gone_metrics(m)
        yield m._ttfb.family()
        yield m._duration.family()
        yield m._queue_wait.family()
        if m.policy_snapshot is not None:
            yield from _policy_metrics(_safe(m.policy_snapshot))
        if m.scraper_stats is not None:
            yield from _scraper_metrics(_safe(m.scraper_stats))
        if m.scraper_node_stats is not None:
            yield self._scrape_histogram()

    def _scrape_histogram(self) -> Metric:
        """Scrape durations observed since the last collection, added to running buckets."""
        m = self._m
        try:
            stats = m.scraper_node_stats() if m.scraper_node_stats else {}
        except Exception:
            stats = {}
        for node_id, node in stats.items():
            for latency in node.drain_latencies():
                m._scrape.observe(node_id, latency)
        return m._scrape.family()


def _client_gone_metrics(m: GatewayMetrics) -> Iterator[Metric]:
    """What the relay saw of streams whose client left: the measure behind zombie tokens."""
    for name, doc, value in (
        (
            "kvgate_client_gone_streams",
            "Streams whose client disconnected before the end.",
            m.client_gone_streams,
        ),
        (
            "kvgate_client_gone_stream_events",
            "SSE data events relayed to clients before they disconnected mid-stream.",
            m.client_gone_events,
        ),
        (
            "kvgate_events_after_client_gone",
            "SSE data events received from the upstream after a client disconnect was"
            " noticed (the relay stops reading at once: expected 0).",
            m.events_after_client_gone,
        ),
    ):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], value)
        yield family


def _safe(fn: SnapshotFn) -> Mapping[str, Any]:
    """A broken snapshot must not break `/metrics` (nor the gateway)."""
    try:
        result = fn()
    except Exception:
        logging.getLogger(__name__).exception("snapshot for /metrics failed")
        return {}
    return result if isinstance(result, Mapping) else {}


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _counter(
    name: str, doc: str, labels: list[str], values: Mapping[Any, int]
) -> CounterMetricFamily:
    """`values` maps a tuple of label values (one per label) to the count."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in list(values.items()):
        family.add_metric(list(key), value)
    return family


def _nodes(snapshot: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Nodes from a snapshot that lists them as a mapping or as a list of `{"node_id"}`."""
    nodes = snapshot.get("nodes")
    if isinstance(nodes, Mapping):
        for node_id, state in nodes.items():
            if isinstance(state, Mapping):
                yield str(node_id), state
    elif isinstance(nodes, list):
        for state in nodes:
            if isinstance(state, Mapping):
                node_id = state.get("node_id", state.get("name", state.get("id")))
                if node_id is not None:
                    yield str(node_id), state


# (metric name, help, keys tried in order in each node's state)
_NODE_GAUGES = (
    ("kvgate_node_kv_usage", "KV-cache usage the engine last reported (0-1).", ("kv_usage",)),
    (
        "kvgate_node_predicted_usage",
        "Reported KV usage plus reservations the engine cannot show yet (0-1).",
        ("predicted_usage", "predicted_kv_usage"),
    ),
    (
        "kvgate_node_planned_peak",
        "The highest KV usage the node is planned to reach with what runs on it (0-1): what"
        " admission decides on.",
        ("peak_usage",),
    ),
    (
        "kvgate_node_margin",
        "How far feedback has lowered the node's ceilings for non-critical work (0-1).",
        ("margin",),
    ),
    (
        "kvgate_node_ceiling",
        "The planned peak the node may reach with standard work cheap to recompute (0-1;"
        " above 1: planned above the cache, where its engine's measurement allows).",
        ("ceiling",),
    ),
    (
        "kvgate_node_prefill_seconds_per_token",
        "The node's measured prefill pace: what recomputing a preempted request costs.",
        ("prefill_s_per_token",),
    ),
    (
        "kvgate_node_tpot_seconds",
        "Seconds per output token the node's streams get (preempted requests' stalls in).",
        ("tpot_s",),
    ),
    (
        "kvgate_node_recompute_share",
        "The share of the engine's time its recent preemptions cost in recomputation.",
        ("recompute_share",),
    ),
    (
        "kvgate_inflight_tokens",
        "KV tokens reserved by requests admitted to the node and not yet released.",
        ("inflight_tokens", "reserved_tokens", "reservations_tokens"),
    ),
    (
        "kvgate_node_prefix_hit_rate_predicted",
        "Share of the prompt tokens sent to the node that its prefix index predicted cached.",
        ("prefix_hit_rate_predicted",),
    ),
    (
        "kvgate_node_prefix_hit_rate_seen",
        "The engine's own prefix cache hit rate since it started (vLLM's prefix_cache_hits"
        " / prefix_cache_queries).",
        ("prefix_hit_rate_seen",),
    ),
    (
        "kvgate_node_prefix_index_blocks",
        "KV blocks the node's prefix index holds (its engine's cache as kvgate knows it).",
        ("prefix_index_blocks",),
    ),
    (
        "kvgate_node_sample_age_seconds",
        "Age of the node's last good sample.",
        ("age_s", "sample_age_s"),
    ),
)


def _policy_metrics(snapshot: Mapping[str, Any]) -> Iterator[Metric]:
    nodes = list(_nodes(snapshot))
    for name, doc, keys in _NODE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["node"])
        for node_id, state in nodes:
            value = next((_number(state.get(k)) for k in keys if k in state), None)
            for part in ("sample", "measured"):  # the engine's sample, the ceiling's inputs
                if value is None and isinstance(state.get(part), Mapping):
                    value = next((_number(state[part].get(k)) for k in keys), None)
            if value is not None:
                family.add_metric([node_id], value)
        yield family
    yield _one_hot(
        "kvgate_node_state",
        "The node's state for admission (fresh levels ok/high/panic, lagging, thrashing,"
        " stale, dead, unknown); see docs/operating.md.",
        "state",
        "state",
        STATES,
        nodes,
    )
    yield _one_hot(
        "kvgate_node_ceiling_reason",
        "Why the node's ceiling is where it is (overbooking, ramping back, cut for latency,"
        " recomputation or collapse, fixed); see docs/flow-control.md.",
        "reason",
        "ceiling_reason",
        REASONS,
        nodes,
    )
    queue = snapshot.get("queue")
    if isinstance(queue, Mapping):
        yield from queue_metrics(queue)


def _one_hot(
    name: str,
    doc: str,
    label: str,
    key: str,
    values: tuple[str, ...],
    nodes: list[tuple[str, Mapping[str, Any]]],
) -> Metric:
    """`name{node,<label>}`: 1 for the value of the node's `key` field, 0 for every other
    value it can take (all are listed, so that `sum by (<label>)` and alerts on one value
    work)."""
    family = GaugeMetricFamily(name, doc, labels=["node", label])
    for node_id, state in nodes:
        current = state.get(key)
        if isinstance(current, str):
            for value in values:
                family.add_metric([node_id, value], 1.0 if value == current else 0.0)
    return family


def _scraper_metrics(stats: Mapping[str, Any]) -> Iterator[Metric]:
    latency = GaugeMetricFamily(
        "kvgate_scrape_latency_seconds",
        "Duration of the last scrape of the node's metrics page.",
        labels=["node"],
    )
    failures = CounterMetricFamily(
        "kvgate_scrape_failures",
        "Scrapes that failed (refused, HTTP error, unparseable page, or hung past the bound).",
        labels=["node"],
    )
    hedges = CounterMetricFamily(
        "kvgate_scrape_hedges",
        "Extra GETs of the node's page started because the one out had waited stale_after_s"
        " (the first page to come is the sample): a page that hangs or answers late.",
        labels=["node"],
    )
    running = GaugeMetricFamily(
        "kvgate_scrape_in_flight_seconds",
        "How long the node's scrape in flight has been waiting for its page (0: none is).",
        labels=["node"],
    )
    period = GaugeMetricFamily(
        "kvgate_scrape_period_seconds",
        "Time between the starts of the node's scrapes: the interval, longer while the"
        " page is slow.",
        labels=["node"],
    )
    for node_id, state in _nodes(stats):
        value = next(
            (
                _number(state.get(k))
                for k in ("last_latency_s", "latency_s", "scrape_latency_s")
                if k in state
            ),
            None,
        )
        if value is not None:
            latency.add_metric([node_id], value)
        count = next(
            (_number(state.get(k)) for k in ("failures", "failures_total") if k in state), None
        )
        if count is not None:
            failures.add_metric([node_id], count)
        if (hedged := _number(state.get("hedges_total"))) is not None:
            hedges.add_metric([node_id], hedged)
        if "in_flight_s" in state:
            running.add_metric([node_id], _number(state.get("in_flight_s")) or 0.0)
        if (value := _number(state.get("period_s"))) is not None:
            period.add_metric([node_id], value)
    yield latency
    yield failures
    yield hedges
    yield running
    yield period


class BufferedLineWriter:
    """Access-log lines for one file descriptor, written in batches.

    A relay that answers thousands of requests per second should not pay a `LogRecord` and
    a write syscall per request (measured: ~15% of the relay's CPU per request). Lines are
    appended to a buffer and written when `max_bytes` accumulate or `interval_s` after the
    first unwritten line, and by `flush()` at exit.
    """

    def __init__(self, fd: int, interval_s: float = 0.1, max_bytes: int = 64 * 1024) -> None:
        self._fd = fd
        self._interval_s = interval_s
        self._max_bytes = max_bytes
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None

    def write(self, line: bytes) -> None:
        self._buffer += line
        self._buffer += b"\n"
        if len(self._buffer) >= self._max_bytes:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = loop.call_later(self._interval_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        view = memoryview(self._buffer)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError:
            pass  # a closed or broken stderr must not break the relay
        finally:
            view.release()
            self._buffer.clear()


_writer: BufferedLineWriter | None = None
_render: Callable[[dict[str, Any]], bytes] = orjson.dumps


def set_access_writer(
    writer: BufferedLineWriter | None, render: Callable[[dict[str, Any]], bytes] = orjson.dumps
) -> None:
    """Send access lines to `writer` instead of the `kvgate.access` logger (None: logger),
    each record made a line by `render` (kvgate.gateway.ops.logs: the log format's)."""
    global _writer, _render
    _writer = writer
    _render = render


def log_access(record: dict[str, Any]) -> None:
    """Write one request's line (only if someone listens: no work when disabled)."""
    if _writer is not None:
        _writer.write(_render(record))
    elif access_logger.isEnabledFor(logging.INFO):
        access_logger.info(orjson.dumps(record).decode())
