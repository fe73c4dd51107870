"""Direct rendering of the /metrics page versus prometheus_client (a custom collector).

    python benchmarks/sim_capacity/metrics_render.py

Both produce the same families from the same engine state; the prometheus_client variant
is the cheapest way to use it here (a Collector yielding metric families at scrape time:
per-token `Histogram.observe` calls in the engine loop would cost far more). CPU time per
page, median of 5 rounds of 500 renders.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim.metrics import MetricsPage
from kvgate.sim.model.engine import Engine
from kvgate.sim.model.histogram import Histogram
from kvgate.testing import overloaded_engine

LABELS = ["engine", "model_name"]
VALUES = ["0", "sim-llama"]


class EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        for name, value in (
            ("vllm:num_requests_running", e.num_running),
            ("vllm:num_requests_waiting", e.num_waiting),
            ("vllm:kv_cache_usage_perc", e.kv_usage),
        ):
            g = GaugeMetricFamily(name, name, labels=LABELS)
            g.add_metric(VALUES, value)
            yield g
        for name, value in (
            ("vllm:num_preemptions", e.preemptions_total),
            ("vllm:prompt_tokens", e.prompt_tokens_total),
            ("vllm:generation_tokens", e.generation_tokens_total),
            ("sim:zombie_tokens", e.zombie_tokens_total),
            ("sim:recomputed_tokens", e.recomputed_tokens_total),
        ):
            c = CounterMetricFamily(name, name, labels=LABELS)
            c.add_metric(VALUES, value)
            yield c
        s = CounterMetricFamily("vllm:request_success", "ok", labels=[*LABELS, "finished_reason"])
        for reason, value in e.success_total.items():
            s.add_metric([*VALUES, reason], value)
        yield s
        for name, hist in (
            ("vllm:iteration_tokens_total", e.iteration_tokens),
            ("vllm:time_to_first_token_seconds", e.ttft),
            ("vllm:inter_token_latency_seconds", e.itl),
            ("vllm:e2e_request_latency_seconds", e.e2e),
        ):
            yield self._histogram(name, hist)

    def _histogram(self, name: str, hist: Histogram) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, name, labels=LABELS)
        cumulative = hist.cumulative()
        buckets = [(repr(b), c) for b, c in zip(hist.bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        h.add_metric(VALUES, buckets, hist.sum)
        return h


def cpu_per_call(fn: object, rounds: int = 5, calls: int = 500) -> float:
    samples = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        samples.append((time.process_time() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    engine = overloaded_engine()
    page = MetricsPage(engine, "sim-llama")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))  # type: ignore[arg-type]
    direct = cpu_per_call(page.render)
    client = cpu_per_call(lambda: generate_latest(registry))
    for text in (page.render(), generate_latest(registry).decode()):
        assert {f.name for f in text_string_to_metric_families(text)} >= {
            "vllm:kv_cache_usage_perc",
            "vllm:inter_token_latency_seconds",
        }
    print(f"| direct render | {1e6 * direct:.0f} us per page |")
    print(f"| prometheus_client collector + generate_latest | {1e6 * client:.0f} us per page |")


if __name__ == "__main__":
    main()
