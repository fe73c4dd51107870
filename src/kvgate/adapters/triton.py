"""Triton Inference Server with the TensorRT-LLM backend: `nv_trt_llm_*` gauges to
`NodeSample`.

Triton packs several signals into one family told apart by a label:
`nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used|free|max|fraction|tokens_per"}`
and `nv_trt_llm_request_metrics{request_type="waiting|scheduled|active|context|max"}`.
Several TensorRT-LLM models in one server: counts are summed, usage is capacity-weighted.
Triton's metrics listen on their own port (8002 by default), so give `metrics_url` unless
that default fits. There is no
per-token latency series and no HTTP abort API (gRPC cancellation or disconnect only).
"""

from __future__ import annotations

from kvgate.adapters.base import (
    MetricScanner,
    MetricsParseError,
    NoAbortAPI,
    Series,
    capacity_weighted_usage,
    count,
    fraction,
    grouped,
    non_negative,
    require,
    with_label,
)
from kvgate.core.signals import NodeSample

KV = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"
_KV_TYPE = "kv_cache_block_type"
_REQ_TYPE = "request_type"

_SCANNER = MetricScanner([KV, REQUESTS])

METRICS_PORT = 8002


def _sum(series: list[Series], label: str, value: str) -> float | None:
    picked = with_label(series, label, value)
    return sum(s.value for s in picked) if picked else None


class TritonAdapter(NoAbortAPI):
    """One Triton server hosting TensorRT-LLM model(s)."""

    kind = "triton"

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        _, kv = require(found, KV)
        _, requests = require(found, REQUESTS)
        parts = [_model_kv(series) for series in grouped(kv, "model").values()]
        waiting = _sum(requests, _REQ_TYPE, "waiting")
        running = _sum(requests, _REQ_TYPE, "scheduled")
        if running is None:
            running = _sum(requests, _REQ_TYPE, "active")
        if waiting is None or running is None:
            raise MetricsParseError(f"{REQUESTS}: request_type waiting and scheduled/active needed")
        capacities = [cap for _, cap in parts]
        return NodeSample(
            kv_usage=capacity_weighted_usage(parts),
            kv_capacity_tokens=None if None in capacities else sum(capacities),  # type: ignore[arg-type]
            running=count(running, REQUESTS),
            waiting=count(waiting, REQUESTS),
            iteration_latency_s=None,
            sampled_at=now,
        )


def _model_kv(kv: list[Series]) -> tuple[float, int | None]:
    """One model's (usage, capacity in tokens). Usage is the backend's own `fraction` gauge
    when exported, else used / max blocks."""
    used, max_blocks = _sum(kv, _KV_TYPE, "used"), _sum(kv, _KV_TYPE, "max")
    tokens_per = _sum(kv, _KV_TYPE, "tokens_per")
    capacity = None
    if max_blocks and tokens_per:
        capacity = count(max_blocks, KV) * count(tokens_per, KV) or None
    fractions = with_label(kv, _KV_TYPE, "fraction")
    if fractions:
        return fraction(max(s.value for s in fractions), KV), capacity
    if used is not None and max_blocks:
        return fraction(non_negative(used, KV) / max_blocks, KV), capacity
    raise MetricsParseError(f"{KV}: neither a fraction nor used and max blocks")
