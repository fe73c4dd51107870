"""Writes `kvgate-dashboard.json`, the Grafana dashboard for kvgate and the vLLM engines.

The JSON is generated so that the ~30 panels stay consistent (same datasource, same units,
same layout rules) and reviewable as code; the committed JSON is what operators import.
A test checks that the committed file equals this script's output and that every query
names a metric kvgate or vLLM really exports.

    python deploy/grafana/generate.py          # rewrite the JSON next to this file

Label conventions: kvgate labels per-engine series `node` (the backend's name, default
`host:port`); the Prometheus example relabels each vLLM target's address into `node` too,
so an engine's own KV gauge and kvgate's view of it share a label.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24
OUT = Path(__file__).with_name("kvgate-dashboard.json")
PRIORITY_COLORS = {"critical": "purple", "standard": "blue", "sheddable": "orange"}


class Layout:
    """Places panels left to right, wrapping rows, and hands out unique ids."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_height = 0
        self.next_id = 1
        self.panels: list[dict[str, Any]] = []

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > WIDTH:
            self.x, self.y = 0, self.y + self.row_height
            self.row_height = 0
        panel["id"] = self.next_id
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.next_id += 1
        self.x += w
        self.row_height = max(self.row_height, h)
        self.panels.append(panel)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + self.row_height
        self.row_height = 0
        self.add({"type": "row", "title": title, "collapsed": False, "panels": []}, WIDTH, 1)
        self.x, self.y, self.row_height = 0, self.y + 1, 0


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def timeseries(
    title: str,
    description: str,
    queries: list[tuple[str, str]],
    unit: str = "short",
    *,
    stack: bool = False,
    max_value: float | None = None,
    overrides: list[dict[str, Any]] | None = None,
    thresholds: list[tuple[float, str]] | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if thresholds else "off"},
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    if thresholds:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}]
            + [{"color": color, "value": value} for value, color in thresholds],
        }
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)
        ],
    }


def stat(
    title: str,
    description: str,
    expr: str,
    unit: str,
    steps: list[tuple[float | None, str]],
) -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": color, "value": value} for value, color in steps],
                },
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background",
            "graphMode": "area",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        },
        "targets": [target(expr, title, "A")],
    }


def priority_colors() -> list[dict[str, Any]]:
    return [
        {
            "matcher": {"id": "byName", "options": name},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
        }
        for name, color in PRIORITY_COLORS.items()
    ]


ADMITTED = 'kvgate_admissions_total{decision="admitted"}'
REJECTED = 'kvgate_admissions_total{decision="rejected"}'
NODE = 'node=~"$node"'
RI = "$__rate_interval"


def overview(lay: Layout) -> None:
    lay.row("Now")
    lay.add(
        stat(
            "Admitted /s",
            "Requests admitted per second, all priorities.",
            f"sum(rate({ADMITTED}[{RI}]))",
            "reqps",
            [(None, "blue")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Refusal ratio",
            "Share of admission decisions that were refusals (429/503 with Retry-After, 400):"
            " requests that could not start or wait for room.",
            f"sum(rate({REJECTED}[{RI}])) / clamp_min(sum(rate(kvgate_admissions_total[{RI}])),"
            " 1e-9)",
            "percentunit",
            [(None, "green"), (0.05, "yellow"), (0.25, "red")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Stale nodes",
            "Engines kvgate sends no new work for want of signals: stale, dead or never"
            " heard from (docs/operating.md, node states).",
            'sum(kvgate_node_state{state=~"stale|dead|unknown"}) or vector(0)',
            "short",
            [(None, "green"), (1, "red")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Max predicted KV",
            "Highest predicted KV-cache usage over all nodes (reported + reservations).",
            "max(kvgate_node_predicted_usage)",
            "percentunit",
            [(None, "green"), (0.8, "yellow"), (0.92, "red")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "In-flight requests",
            "Requests the gateway is serving now.",
            "sum(kvgate_requests_in_flight)",
            "short",
            [(None, "blue")],
        ),
        4,
        4,
    )
    lay.add(
        stat(
            "Cancel propagation p99",
            "From noticing a client disconnect to closing the upstream request (should be ~1 ms).",
            "histogram_quantile(0.99, sum by (le) "
            f"(rate(kvgate_cancel_propagation_seconds_bucket[{RI}])))",
            "s",
            [(None, "green"), (0.05, "red")],
        ),
        4,
        4,
    )


def admission(lay: Layout) -> None:
    lay.row("Admission")
    lay.add(
        timeseries(
            "Admitted per second, by priority",
            "Admission decisions that let the request through.",
            [(f"sum by (priority) (rate({ADMITTED}[{RI}]))", "{{priority}}")],
            "reqps",
            stack=True,
            overrides=priority_colors(),
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Rejected per second, by priority",
            "Shed requests (each answered 429 or 503 with a Retry-After).",
            [(f"sum by (priority) (rate({REJECTED}[{RI}]))", "{{priority}}")],
            "reqps",
            stack=True,
            overrides=priority_colors(),
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Rejected per second, by reason",
            "kv_planned_peak: backpressure (the planned peak passes the ceiling); kv_panic: a"
            " node above the panic watermark; no_fresh_node: every candidate is stale.",
            [(f"sum by (reason) (rate({REJECTED}[{RI}]))", "{{reason}}")],
            "reqps",
            stack=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Waiting in the gateway's queue",
            "Requests waiting for room in the gateway (not in an engine's KV cache), by priority.",
            [("sum by (priority) (kvgate_queue_waiting)", "{{priority}}")],
            "short",
            overrides=priority_colors(),
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Responses by status",
            "What clients get back: 200s, 429s (refused, retry later), 503s, upstream errors.",
            [(f"sum by (status) (rate(kvgate_requests_total[{RI}]))", "{{status}}")],
            "reqps",
            stack=True,
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "In-flight: requests and reserved KV tokens",
            "Reserved tokens are admitted requests' prompt + max_tokens not yet released.",
            [
                ("sum(kvgate_requests_in_flight)", "requests"),
                ("sum(kvgate_inflight_tokens)", "reserved KV tokens"),
            ],
            "short",
            overrides=[
                {
                    "matcher": {"id": "byName", "options": "reserved KV tokens"},
                    "properties": [{"id": "custom.axisPlacement", "value": "right"}],
                }
            ],
        ),
        8,
        8,
    )


def kv_cache(lay: Layout) -> None:
    lay.row("KV cache per node")
    lay.add(
        timeseries(
            "KV usage reported by the engines (kvgate's scrape)",
            "The engine's own KV-cache usage, as kvgate last scraped it.",
            [(f"kvgate_node_kv_usage{{{NODE}}}", "{{node}}")],
            "percentunit",
            max_value=1,
            thresholds=[(0.8, "yellow"), (0.92, "red")],
        ),
        8,
        9,
    )
    lay.add(
        timeseries(
            "KV peak planned by kvgate, and its ceiling",
            "The highest KV usage each node is planned to reach with what runs on it (each"
            " request growing to its expected end): what admission decides on; and the"
            " ceiling it may reach with standard work cheap to recompute (above 100%:"
            " planned above the cache where the engine measured preemption cheap)."
            " Dashed: high (0.80) and panic (0.92) watermarks.",
            [
                (f"kvgate_node_planned_peak{{{NODE}}}", "{{node}}"),
                (f"max by (node) (kvgate_node_ceiling{{{NODE}}})", "{{node}} ceiling"),
            ],
            "percentunit",
            thresholds=[(0.8, "yellow"), (0.92, "red")],
        ),
        8,
        9,
    )
    lay.add(
        timeseries(
            "Why each node's ceiling is where it is",
            "One line per node and reason while it holds: overbooking (planned above the"
            " cache for requests cheap to recompute), ramping (regaining it after a cut),"
            " latency, recompute, collapse (cut to the watermarks for that), fixed (an"
            " engine kvgate cannot measure).",
            [
                (
                    f"max by (node, reason) (kvgate_node_ceiling_reason{{{NODE}}}) == 1",
                    "{{node}}: {{reason}}",
                )
            ],
            "short",
            max_value=1,
        ),
        8,
        9,
    )
    lay.add(
        timeseries(
            "Prefix cache hits per engine",
            "Solid: the engine's own hit rate since it started (vLLM's prefix_cache_hits /"
            " prefix_cache_queries). Predicted: the share of the prompt tokens kvgate sent"
            " there that its prefix index expected cached (prefix routing only). A predicted"
            " rate well above the engine's means the index is stale (lost KV events, an"
            " engine restart) or its cache smaller than kvgate thinks.",
            [
                (f"kvgate_node_prefix_hit_rate_seen{{{NODE}}}", "{{node}} engine"),
                (f"kvgate_node_prefix_hit_rate_predicted{{{NODE}}}", "{{node}} predicted"),
            ],
            "percentunit",
            max_value=1,
        ),
        8,
        9,
    )
    lay.add(
        timeseries(
            "KV usage, engine's own page (vLLM)",
            "vllm:kv_cache_usage_perc scraped by Prometheus directly: should match kvgate's "
            "scrape; a gap means kvgate's view is off.",
            [(f"max by (node) (vllm:kv_cache_usage_perc{{{NODE}}})", "{{node}}")],
            "percentunit",
            max_value=1,
            thresholds=[(0.8, "yellow"), (0.92, "red")],
        ),
        8,
        9,
    )
    lay.add(
        timeseries(
            "Reserved KV tokens per node",
            "Tokens reserved on each node by admitted requests and not yet released.",
            [(f"kvgate_inflight_tokens{{{NODE}}}", "{{node}}")],
            "short",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Preemptions per second (vLLM)",
            "Sequences evicted from the KV cache and recomputed: kvgate's choice while a"
            " node's ceiling is overbooking (preemption measured cheap there), thrashing"
            " otherwise.",
            [(f"sum by (node) (rate(vllm:num_preemptions_total{{{NODE}}}[{RI}]))", "{{node}}")],
            "short",
        ),
        12,
        8,
    )


def engines(lay: Layout) -> None:
    lay.row("Engines (vLLM)")
    lay.add(
        timeseries(
            "Running and waiting requests",
            "The engine's batch (running) and its own queue (waiting); a long waiting queue "
            "means kvgate admits more than the engine can start.",
            [
                (f"sum by (node) (vllm:num_requests_running{{{NODE}}})", "running {{node}}"),
                (f"sum by (node) (vllm:num_requests_waiting{{{NODE}}})", "waiting {{node}}"),
            ],
            "short",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Inter-token latency p50 / p99 (vLLM)",
            "Time between two output tokens: the iteration latency a full batch drives up.",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(vllm:inter_token_latency_seconds_bucket{{{NODE}}}[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(vllm:inter_token_latency_seconds_bucket{{{NODE}}}[{RI}])))",
                    "p99",
                ),
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Generated tokens per second (vLLM)",
            "Useful output: goodput rises with admission control, it does not fall.",
            [(f"sum by (node) (rate(vllm:generation_tokens_total{{{NODE}}}[{RI}]))", "{{node}}")],
            "short",
            stack=True,
        ),
        8,
        8,
    )


def latency(lay: Layout) -> None:
    lay.row("Latency")
    lay.add(
        timeseries(
            "Time to first byte at the gateway",
            "From request arrival at kvgate to the first byte sent back.",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvgate_time_to_first_byte_seconds_bucket[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvgate_time_to_first_byte_seconds_bucket[{RI}])))",
                    "p99",
                ),
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Time to first token at the engines (vLLM)",
            "The engine's own TTFT; the difference to the gateway's TTFB is kvgate's overhead "
            "plus the network.",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(vllm:time_to_first_token_seconds_bucket{{{NODE}}}[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(vllm:time_to_first_token_seconds_bucket{{{NODE}}}[{RI}])))",
                    "p99",
                ),
            ],
            "s",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Request duration at the gateway",
            "From arrival to the end of the response, however it ended.",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvgate_request_duration_seconds_bucket[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvgate_request_duration_seconds_bucket[{RI}])))",
                    "p99",
                ),
            ],
            "s",
        ),
        8,
        8,
    )


def health(lay: Layout) -> None:
    lay.row("Signals and cancellation")
    lay.add(
        timeseries(
            "Sample age per node",
            "Age of each engine's last good sample; above 1 s (admission.stale_after_s) the "
            "node is lagging if kvgate sees it serve tokens (admission goes on from its books),"
            " else stale (no new work).",
            [(f"kvgate_node_sample_age_seconds{{{NODE}}}", "{{node}}")],
            "s",
            thresholds=[(1.0, "red")],
        ),
        6,
        8,
    )
    lay.add(
        timeseries(
            "Scrape latency and failures",
            "How long kvgate's last scrape of each engine took, how long the one in flight"
            " has waited, and failed scrapes per second.",
            [
                (f"kvgate_scrape_latency_seconds{{{NODE}}}", "latency {{node}}"),
                (f"kvgate_scrape_in_flight_seconds{{{NODE}}}", "waiting {{node}}"),
                (
                    f"sum by (node) (rate(kvgate_scrape_failures_total{{{NODE}}}[{RI}]))",
                    "failures/s {{node}}",
                ),
            ],
            "short",
        ),
        6,
        8,
    )
    lay.add(
        timeseries(
            "Cancellations propagated per second",
            "Client disconnects carried into the engine, by the stage the request was in.",
            [(f"sum by (stage) (rate(kvgate_cancellations_propagated_total[{RI}]))", "{{stage}}")],
            "short",
            stack=True,
        ),
        6,
        8,
    )
    lay.add(
        timeseries(
            "Cancel propagation latency",
            "From the client's disconnect to the upstream request being closed (engine aborts).",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvgate_cancel_propagation_seconds_bucket[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvgate_cancel_propagation_seconds_bucket[{RI}])))",
                    "p99",
                ),
            ],
            "s",
            thresholds=[(0.05, "red")],
        ),
        6,
        8,
    )
    lay.add(
        timeseries(
            "Upstream errors and retries",
            "Failures talking to engines (connect, reset, timeout, status) and requests "
            "retried on another engine before any byte was sent.",
            [
                (f"sum by (kind) (rate(kvgate_upstream_errors_total[{RI}]))", "{{kind}}"),
                (f"sum(rate(kvgate_upstream_retries_total[{RI}]))", "retried"),
            ],
            "reqps",
        ),
        12,
        8,
    )


def replicas(lay: Layout) -> None:
    """Replicas sharing a store (`store.url`, `--workers`); empty without one. Per-replica
    series are told apart by Prometheus's `instance` label (one target per replica)."""
    lay.row("Replicas and the shared store")
    lay.add(
        stat(
            "Replicas in the store",
            "Live replicas in the store's membership (the most any replica sees): each one"
            " plans every replica's requests and fills only its share of each engine's room.",
            "max(kvgate_replicas)",
            "short",
            [(None, "blue")],
        ),
        4,
        8,
    )
    lay.add(
        stat(
            "Isolated replicas",
            "Replicas with no good sync with Redis: each keeps to a static 1/N share of every"
            " engine's room and tenant limit until the store answers again.",
            "count(kvgate_store_up == 0) or vector(0)",
            "short",
            [(None, "green"), (1, "red")],
        ),
        4,
        8,
    )
    lay.add(
        timeseries(
            "Membership and store health per replica",
            "Replicas each one sees in the store, and 1/0 while it syncs / is isolated.",
            [
                ("kvgate_replicas", "members seen by {{instance}}"),
                ("kvgate_store_up", "in sync {{instance}}"),
            ],
            "short",
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Store sync round trip",
            "One Redis round trip per replica every 50 ms (no request waits for one). Dashed:"
            " the 150 ms sync timeout; two late syncs in a row isolate a replica.",
            [
                (
                    "histogram_quantile(0.5, sum by (le) "
                    f"(rate(kvgate_store_sync_seconds_bucket[{RI}])))",
                    "p50",
                ),
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(kvgate_store_sync_seconds_bucket[{RI}])))",
                    "p99",
                ),
            ],
            "s",
            thresholds=[(0.15, "red")],
        ),
        8,
        8,
    )
    lay.add(
        timeseries(
            "Store failures and isolations",
            "Syncs that failed or timed out, and falls back to the isolated share, per second.",
            [
                (
                    f"sum by (instance) (rate(kvgate_store_sync_failures_total[{RI}]))",
                    "failures/s {{instance}}",
                ),
                (
                    f"sum by (instance) (rate(kvgate_store_isolations_total[{RI}]))",
                    "isolations/s {{instance}}",
                ),
            ],
            "short",
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Engines polled and shared per replica",
            "Engines each replica polls itself (scraped) or takes from the replica that owns"
            " them (shared): with every replica in sync each engine is polled once.",
            [
                ('kvgate_replica_engines{role="scraped"}', "scraped by {{instance}}"),
                ('kvgate_replica_engines{role="shared"}', "shared to {{instance}}"),
            ],
            "short",
        ),
        12,
        8,
    )


def tenants(lay: Layout) -> None:
    """Tenants' budgets (`auth.tenants.<name>.tokens_per_minute`, ...); empty without.
    Every replica reports the same budget and what is left of it; each its own spending."""
    lay.row("Tenant budgets")
    lay.add(
        timeseries(
            "Tenant budgets: what is left",
            "What is left of each tenant's budget, per window, as a share of it (the lowest"
            " any replica reports). Near 0: the tenant uses all its share, and its requests"
            " wait for the refill or get 429 tenant_budget with the refill time.",
            [
                (
                    "min by (tenant, window) "
                    "(kvgate_tenant_budget_remaining / kvgate_tenant_budget_limit)",
                    "{{tenant}} {{window}}",
                )
            ],
            "percentunit",
            max_value=1,
            thresholds=[(0.1, "red")],
        ),
        12,
        8,
    )
    lay.add(
        timeseries(
            "Tenant budgets: use and refusals",
            "What each tenant uses of its budgets per second (tokens or requests, summed"
            " over replicas; a budget per minute allows its size / 60), and the requests"
            " refused for its budget per second.",
            [
                (
                    f"sum by (tenant, window) (rate(kvgate_tenant_budget_spent_total[{RI}]))",
                    "{{tenant}} {{window}} used/s",
                ),
                (
                    f"sum by (tenant) (rate(kvgate_tenant_budget_refused_total[{RI}]))",
                    "{{tenant}} refused/s",
                ),
            ],
            "short",
        ),
        12,
        8,
    )


def dashboard() -> dict[str, Any]:
    lay = Layout()
    for section in (overview, admission, kv_cache, engines, latency, health, replicas, tenants):
        section(lay)
    return {
        "title": "kvgate: KV-aware admission",
        "uid": "kvgate-overview",
        "description": "What each engine reports, what kvgate plans, and what it refuses.",
        "tags": ["kvgate", "vllm", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "node",
                    "label": "node",
                    "type": "query",
                    "datasource": DS,
                    "definition": "label_values(kvgate_node_kv_usage, node)",
                    "query": {
                        "query": "label_values(kvgate_node_kv_usage, node)",
                        "refId": "node",
                    },
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "sort": 3,
                    "hide": 0,
                },
            ]
        },
        "panels": lay.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {OUT}")
