"""kvgate's own metrics: latency histograms, the nodes' and the queue's gauges."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController
from kvgate.core.policies.baselines import build_named
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.gateway.ops.queue_metrics import queue_metrics
from kvgate.gateway.ops.telemetry import GatewayMetrics


def _samples(metrics: GatewayMetrics, name: str) -> dict[tuple[str, tuple], float]:
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name == name:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    raise AssertionError(f"{name} not exposed")


def test_route_histograms_count_each_value_in_its_le_bucket() -> None:
    metrics = GatewayMetrics()
    for seconds in (0.0005, 0.001, 0.0011, 0.3, 1000.0):  # 0.001 is "le 0.001" inclusive
        metrics.observe_ttfb("/v1/completions", seconds)
    metrics.observe_duration("/v1/chat/completions", 2.0)
    ttfb = _samples(metrics, "kvgate_time_to_first_byte_seconds")
    route = ("route", "/v1/completions")

    def bucket(le: str) -> float:
        return ttfb[("kvgate_time_to_first_byte_seconds_bucket", (("le", le), route))]

    assert bucket("0.001") == 2
    assert bucket("0.0025") == 3
    assert bucket("0.5") == 4
    assert bucket("600.0") == 4
    assert bucket("+Inf") == 5
    assert ttfb[("kvgate_time_to_first_byte_seconds_count", (route,))] == 5
    assert abs(ttfb[("kvgate_time_to_first_byte_seconds_sum", (route,))] - 1000.3026) < 1e-9
    duration = _samples(metrics, "kvgate_request_duration_seconds")
    chat = ("route", "/v1/chat/completions")
    assert duration[("kvgate_request_duration_seconds_count", (chat,))] == 1
    assert duration[("kvgate_request_duration_seconds_bucket", (("le", "1.0"), chat))] == 0
    assert duration[("kvgate_request_duration_seconds_bucket", (("le", "2.5"), chat))] == 1


def test_each_nodes_ceiling_and_what_it_was_measured_from_are_gauges() -> None:
    clock = ManualClock(100.0)
    policy = build_named("adaptive", AdmissionSettings(), clock)
    policy.observe("a", NodeSample(0.5, 10_000, 1, 0, 0.005, clock.now(), 0.0))
    policy.observe("b", NodeSample(0.5, 10_000, 1, 0, 0.005, clock.now(), None))
    metrics = GatewayMetrics()
    metrics.policy_snapshot = policy.snapshot
    ceiling = _samples(metrics, "kvgate_node_ceiling")
    # Measurable (its preemptions are counted): overbooking allowed; b keeps the watermark.
    assert ceiling[("kvgate_node_ceiling", (("node", "a"),))] > 1.0
    assert ceiling[("kvgate_node_ceiling", (("node", "b"),))] == 0.92
    reasons = _samples(metrics, "kvgate_node_ceiling_reason")
    # One series per reason, 1 for the node's: a overbooks, b's engine cannot be measured.
    current = {
        dict(labels)["node"]: dict(labels)["reason"] for (_, labels), v in reasons.items() if v
    }
    assert current == {"a": "overbooking", "b": "fixed"}
    assert len(reasons) == 2 * 6
    pace = _samples(metrics, "kvgate_node_prefill_seconds_per_token")
    assert pace[("kvgate_node_prefill_seconds_per_token", (("node", "a"),))] > 0
    assert ("kvgate_node_recompute_share", (("node", "a"),)) in _samples(
        metrics, "kvgate_node_recompute_share"
    )


def test_a_deadline_learned_from_a_tenants_clients_is_a_gauge() -> None:
    """Clients of `t` time out after 10 s: `kvgate_client_deadline_seconds{tenant="t"}`;
    a tenant whose clients show none is absent, and so is a broken figure."""
    clock = ManualClock(100.0)
    flow = FlowController(build_named("adaptive", AdmissionSettings(), clock))
    for _ in range(12):
        flow.patience.answered("t", 4.0, clock.now())
        flow.patience.left("t", 10.0, clock.now())
    flow.patience.left("u", 3.0, clock.now())
    metrics = GatewayMetrics()
    metrics.policy_snapshot = flow.snapshot
    deadlines = _samples(metrics, "kvgate_client_deadline_seconds")
    assert list(deadlines) == [("kvgate_client_deadline_seconds", (("tenant", "t"),))]
    assert 9.4 <= deadlines[("kvgate_client_deadline_seconds", (("tenant", "t"),))] <= 10.0
    queue = {"patience": {"tenants": {"v": {"deadline_s": float("nan")}, "w": "broken"}}}
    assert [m.samples for m in queue_metrics(queue) if m.name.startswith("kvgate_client")] == [[]]
