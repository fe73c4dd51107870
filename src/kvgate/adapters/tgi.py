"""Hugging Face text-generation-inference (TGI): `/metrics` to `NodeSample`.

TGI exports no KV-usage gauge. What it has is `tgi_batch_current_max_tokens`, the tokens
the running batch may occupy at its peak (prompt + max_new_tokens of every member), which
is exactly what TGI's own admission reserves against `--max-batch-total-tokens`. When that
budget is configured (`kv_capacity_tokens` of the backend), usage = reserved / budget, a
conservative (upper-bound) usage; without it `kv_usage` is None and the controller relies
on queue, latency and its own reservations. No abort API: disconnect cancels.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.adapters.base import (
    HistogramDelta,
    MetricScanner,
    NoAbortAPI,
    Series,
    count,
    non_negative,
    require,
    total,
    with_label,
)
from kvgate.core.signals import NodeSample

QUEUE = "tgi_queue_size"
BATCH = "tgi_batch_current_size"
BATCH_TOKENS = "tgi_batch_current_max_tokens"
FORWARD = "tgi_batch_forward_duration"  # {method="decode"}: one decode step of the batch
INFERENCE = "tgi_batch_inference_duration"  # older name of the same histogram
MEAN_TPT = "tgi_request_mean_time_per_token_duration"  # per-request mean, coarser

_HISTS = (FORWARD, INFERENCE, MEAN_TPT)
_SCANNER = MetricScanner(
    [QUEUE, BATCH, BATCH_TOKENS] + [f"{h}_{s}" for h in _HISTS for s in ("sum", "count")]
)


class TgiAdapter(NoAbortAPI):
    """One TGI router."""

    kind = "tgi"

    def __init__(self, capacity_tokens: int | None = None) -> None:
        self._capacity = capacity_tokens
        self._latency = HistogramDelta()

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        _, queue = require(found, QUEUE)
        _, batch = require(found, BATCH)
        usage = None
        reserved = found.get(BATCH_TOKENS)
        if self._capacity and reserved:
            usage = min(1.0, non_negative(total(reserved), BATCH_TOKENS) / self._capacity)
        return NodeSample(
            kv_usage=usage,
            kv_capacity_tokens=self._capacity,
            running=count(total(batch), BATCH),
            waiting=count(total(queue), QUEUE),
            iteration_latency_s=self._iteration(found),
            iteration_tokens=self._latency.observed,
            sampled_at=now,
        )

    def _iteration(self, found: Mapping[str, list[Series]]) -> float | None:
        for hist in _HISTS:
            sums, counts = found.get(f"{hist}_sum"), found.get(f"{hist}_count")
            if not sums or not counts:
                continue
            if hist != MEAN_TPT:  # batch histograms are labelled by method: keep decode
                sums = with_label(sums, "method", "decode")
                counts = with_label(counts, "method", "decode")
                if not sums or not counts:
                    continue
            return self._latency.update(
                non_negative(total(sums), hist), non_negative(total(counts), hist)
            )
        return None
