"""llama.cpp `llama-server --metrics`: `/metrics` to `NodeSample`.

Current llama-server exports no KV gauge (`llamacpp:kv_cache_usage_ratio` was removed in
2025), only slots busy (`requests_processing`) and queued (`requests_deferred`). Then
`kv_usage` is None: the controller cannot see the engine's KV and works from its own
reservations against `kv_capacity_tokens` (configure it: `--ctx-size` of the server),
from the queue (deferred > 0 means every slot is busy) and from per-token latency. Old
builds that still export the ratio get it used. No abort API: disconnect cancels.
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

PROCESSING = "llamacpp:requests_processing"
DEFERRED = "llamacpp:requests_deferred"
KV_RATIO = "llamacpp:kv_cache_usage_ratio"  # removed in 2025 builds
GEN_SECONDS = "llamacpp:tokens_predicted_seconds_total"
GEN_TOKENS = "llamacpp:tokens_predicted_total"

_SCANNER = MetricScanner([PROCESSING, DEFERRED, KV_RATIO, GEN_SECONDS, GEN_TOKENS])


class LlamacppAdapter(NoAbortAPI):
    """One llama-server."""

    kind = "llamacpp"

    def __init__(self, capacity_tokens: int | None = None) -> None:
        self._capacity = capacity_tokens
        self._per_token = HistogramDelta()

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        _, processing = require(found, PROCESSING)
        _, deferred = require(found, DEFERRED)
        ratio = optional(found, KV_RATIO)
        return NodeSample(
            kv_usage=fraction(total(ratio), KV_RATIO) if ratio else None,
            kv_capacity_tokens=self._capacity,
            running=count(total(processing), PROCESSING),
            waiting=count(total(deferred), DEFERRED),
            iteration_latency_s=self._latency(found),
            iteration_tokens=self._per_token.observed,
            sampled_at=now,
        )

    def _latency(self, found: Mapping[str, list[Series]]) -> float | None:
        """Seconds spent generating per generated token, between two scrapes: each slot's
        generation time is summed, so this is the per-sequence inter-token latency."""
        seconds, tokens = found.get(GEN_SECONDS), found.get(GEN_TOKENS)
        if not seconds or not tokens:
            return None
        return self._per_token.update(
            non_negative(total(seconds), GEN_SECONDS), non_negative(total(tokens), GEN_TOKENS)
        )
