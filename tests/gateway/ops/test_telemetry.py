"""kvgate's own latency histograms: cheap to observe, exposed as Prometheus histograms."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

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
