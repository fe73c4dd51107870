"""SGLang: `/metrics` page (server started with `--enable-metrics`) to `NodeSample`, and
SGLang's abort API.

Under tensor parallelism several ranks may export the same scheduler gauges (labels
`tp_rank`, `pp_rank`): those are copies of one pool, so we take their max. Data-parallel
ranks (`dp_rank`) are separate pools: counts are summed and usage is capacity-weighted.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from kvgate.adapters.base import (
    AbortAPI,
    HistogramDelta,
    MetricScanner,
    Series,
    capacity_weighted_usage,
    count,
    fraction,
    grouped,
    non_negative,
    optional,
    positive_int_label,
    require,
    total,
)
from kvgate.core.signals import NodeSample

USAGE = "sglang:token_usage"
RUNNING = "sglang:num_running_reqs"
WAITING = "sglang:num_queue_reqs"
CACHE_INFO = "sglang:cache_config_info"  # labels page_size, num_pages (newer versions)
MAX_TOKENS = "sglang:max_total_num_tokens"  # older versions export the pool size as a gauge
ITL = "sglang:inter_token_latency_seconds"
TPOT = "sglang:time_per_output_token_seconds"  # older: per-request mean, a coarser stand-in

_SCANNER = MetricScanner(
    [USAGE, RUNNING, WAITING, CACHE_INFO, MAX_TOKENS]
    + [f"{h}_{s}" for h in (ITL, TPOT) for s in ("sum", "count")]
)

ABORT_PATH = "/abort_request"
_RANK = "dp_rank"


def _max_per_rank(series: list[Series]) -> dict[str, float]:
    return {rank: max(s.value for s in group) for rank, group in grouped(series, _RANK).items()}


class SglangAdapter(AbortAPI):
    """One SGLang server (possibly several DP ranks)."""

    kind = "sglang"
    # SGLang names requests by the `rid` they were sent with; the proxy puts its id there.
    request_id_field: str | None = "rid"

    def __init__(self) -> None:
        self._itl = HistogramDelta()

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        _, usage_series = require(found, USAGE)
        _, running_series = require(found, RUNNING)
        _, waiting_series = require(found, WAITING)
        capacities = self._capacities(found)
        usages = {r: fraction(u, USAGE) for r, u in _max_per_rank(usage_series).items()}
        known = [capacities[r] for r in usages if capacities.get(r) is not None]
        return NodeSample(
            kv_usage=capacity_weighted_usage([(u, capacities.get(r)) for r, u in usages.items()]),
            kv_capacity_tokens=sum(known) if len(known) == len(usages) else None,  # type: ignore[arg-type]
            running=count(sum(_max_per_rank(running_series).values()), RUNNING),
            waiting=count(sum(_max_per_rank(waiting_series).values()), WAITING),
            iteration_latency_s=self._latency(found),
            iteration_tokens=self._itl.observed,
            sampled_at=now,
        )

    @staticmethod
    def _capacities(found: Mapping[str, list[Series]]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for s in optional(found, CACHE_INFO):
            pages = positive_int_label(s, "num_pages", CACHE_INFO)
            size = positive_int_label(s, "page_size", CACHE_INFO)
            out[s.label(_RANK) or ""] = pages * size if pages and size else None
        if not out:
            for rank, value in _max_per_rank(optional(found, MAX_TOKENS)).items():
                out[rank] = count(value, MAX_TOKENS) or None
        return out

    def _latency(self, found: Mapping[str, list[Series]]) -> float | None:
        for hist in (ITL, TPOT):
            sums, counts = found.get(f"{hist}_sum"), found.get(f"{hist}_count")
            if sums and counts:
                return self._itl.update(
                    non_negative(total(sums), hist), non_negative(total(counts), hist)
                )
        return None

    async def abort(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        request_id: str,
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """`POST /abort_request {"rid": request_id}`. The proxy sent the request with that
        `rid` in its body (`request_id_field`; SGLang's OpenAI server accepts the field)."""
        url = base_url.rstrip("/") + ABORT_PATH
        return await self._post_abort(session, url, {"rid": request_id}, headers)
