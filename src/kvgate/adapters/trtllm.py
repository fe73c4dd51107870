"""trtllm-serve (TensorRT-LLM's OpenAI server): Prometheus page to `NodeSample`.

trtllm-serve serves Prometheus text at `/prometheus/metrics` (its `/metrics` answers JSON
iteration stats), so that is the default metrics path for this dialect. It has no abort
API: closing the connection cancels the request.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.adapters.base import (
    HistogramDelta,
    MetricScanner,
    NoAbortAPI,
    Series,
    count,
    fraction,
    non_negative,
    optional,
    require,
    total,
)
from kvgate.core.signals import NodeSample

USAGE = "trtllm_kv_cache_utilization"
RUNNING = "trtllm_num_requests_running"
WAITING = "trtllm_num_requests_waiting"
MAX_BLOCKS = "trtllm_kv_cache_max_blocks"
TOKENS_PER_BLOCK = "trtllm_kv_cache_tokens_per_block"
TPOT = "trtllm_time_per_output_token_seconds"

_SCANNER = MetricScanner(
    [USAGE, RUNNING, WAITING, MAX_BLOCKS, TOKENS_PER_BLOCK, f"{TPOT}_sum", f"{TPOT}_count"]
)

METRICS_PATH = "/prometheus/metrics"


class TrtllmAdapter(NoAbortAPI):
    """One trtllm-serve process."""

    kind = "trtllm"
    metrics_path = METRICS_PATH

    def __init__(self) -> None:
        self._tpot = HistogramDelta()

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        _, usage = require(found, USAGE)
        _, running = require(found, RUNNING)
        _, waiting = require(found, WAITING)
        return NodeSample(
            kv_usage=fraction(max(s.value for s in usage), USAGE),
            kv_capacity_tokens=_capacity(found),
            running=count(total(running), RUNNING),
            waiting=count(total(waiting), WAITING),
            iteration_latency_s=self._latency(found),
            iteration_tokens=self._tpot.observed,
            sampled_at=now,
        )

    def _latency(self, found: Mapping[str, list[Series]]) -> float | None:
        sums, counts = found.get(f"{TPOT}_sum"), found.get(f"{TPOT}_count")
        if not sums or not counts:
            return None
        # TPOT is each finished request's mean time per output token: a coarser stand-in
        # for the per-iteration latency, the best this dialect exports.
        return self._tpot.update(non_negative(total(sums), TPOT), non_negative(total(counts), TPOT))


def _capacity(found: Mapping[str, list[Series]]) -> int | None:
    blocks = optional(found, MAX_BLOCKS)
    per_block = optional(found, TOKENS_PER_BLOCK)
    if not blocks or not per_block:
        return None
    tokens = count(max(s.value for s in blocks), MAX_BLOCKS) * count(
        max(s.value for s in per_block), TOKENS_PER_BLOCK
    )
    return tokens or None
