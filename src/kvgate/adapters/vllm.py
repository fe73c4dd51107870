"""vLLM: `/metrics` page to `NodeSample`, and vLLM's abort-by-id API.

Data-parallel vLLM serves several engines behind one API server and labels each series
with `engine="0"`, `engine="1"`, ...: counts are summed, KV usage is the capacity-weighted
mean (see `capacity_weighted_usage`), histogram totals are summed before the delta.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from urllib.parse import urlencode, urlsplit, urlunsplit

import aiohttp

from kvgate.adapters.base import (
    AbortAPI,
    HistogramDelta,
    MetricScanner,
    Series,
    capacity_weighted_usage,
    count,
    fraction,
    non_negative,
    optional,
    positive_int_label,
    require,
    total,
)
from kvgate.core.signals import NodeSample

USAGE = "vllm:kv_cache_usage_perc"
USAGE_OLD = "vllm:gpu_cache_usage_perc"  # before vLLM v1 renamed it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_INFO = "vllm:cache_config_info"
ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
ITL_SUM_OLD = "vllm:time_per_output_token_seconds_sum"  # pre-v1 name of the same histogram
ITL_COUNT_OLD = "vllm:time_per_output_token_seconds_count"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"

_SCANNER = MetricScanner(
    [
        *(USAGE, USAGE_OLD, RUNNING, WAITING, CACHE_INFO, PREEMPTIONS),
        *(PREFIX_HITS, PREFIX_QUERIES),
        *(ITL_SUM, ITL_COUNT, ITL_SUM_OLD, ITL_COUNT_OLD),
    ]
)

ABORT_PATH = "/inference/v1/abort_requests"


def _by_engine(series: list[Series]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for s in series:
        out[s.label("engine") or ""] += s.value
    return out


class VllmAdapter(AbortAPI):
    """One vLLM node (API server, possibly several data-parallel engines)."""

    kind = "vllm"

    def __init__(self) -> None:
        self._itl = HistogramDelta()
        self._capacity_key: tuple[bytes, ...] | None = None
        self._capacity_memo: dict[str, int | None] = {}
        self._block_size: int | None = None
        #: False once the node answered 403/404 to an abort: it runs without
        #: `--enable-scale-out`, so the connection close is the only abort.

    def parse(self, page: bytes, now: float) -> NodeSample:
        found = _SCANNER.scan(page)
        usage_name, usage_series = require(found, USAGE, USAGE_OLD)
        _, running_series = require(found, RUNNING)
        _, waiting_series = require(found, WAITING)
        capacities = self._capacities(optional(found, CACHE_INFO))
        usages = {e: fraction(u, usage_name) for e, u in _by_engine(usage_series).items()}
        parts = [(u, capacities.get(e)) for e, u in usages.items()]
        known = [c for c in capacities.values() if c is not None]
        return NodeSample(
            kv_usage=capacity_weighted_usage(parts),
            kv_capacity_tokens=sum(known) if known and len(known) == len(capacities) else None,
            running=count(total(running_series), RUNNING),
            waiting=count(total(waiting_series), WAITING),
            iteration_latency_s=self._latency(found),
            iteration_tokens=self._itl.observed,
            sampled_at=now,
            preemptions_total=self._preemptions(found),
            block_size=self._block_size,
            prefix_hits_total=self._counter(found, PREFIX_HITS),
            prefix_queries_total=self._counter(found, PREFIX_QUERIES),
        )

    def narrowed_metrics_url(self, metrics_url: str) -> str | None:
        """`<base>/metrics/?name[]=...` for a plain `<base>/metrics` URL.

        The trailing slash matters: vLLM serves `/metrics` from a FastAPI route that
        ignores the query, and `/metrics/...` from prometheus_client's ASGI app mounted
        beside it, which honours `name[]` (vLLM 0.32, checked on the real CPU engine).
        """
        parts = urlsplit(metrics_url)
        if parts.query or parts.fragment or not parts.path.endswith("/metrics"):
            return None
        query = urlencode([("name[]", name) for name in _SCANNER.names])
        return urlunsplit((parts.scheme, parts.netloc, parts.path + "/", query, ""))

    def metrics_on(self, page: bytes) -> frozenset[str]:
        return frozenset(_SCANNER.scan(page))

    def _capacities(self, info: list[Series]) -> dict[str, int | None]:
        """Per engine: num_gpu_blocks x block_size tokens, from the info gauge's labels.

        The info line (~40 labels) is the same on every scrape: reuse the last result
        while its bytes are unchanged."""
        key = tuple(s.labels_raw for s in info)
        if key == self._capacity_key:
            return self._capacity_memo
        out: dict[str, int | None] = {}
        sizes = set()
        for s in info:
            blocks = positive_int_label(s, "num_gpu_blocks", CACHE_INFO)
            size = positive_int_label(s, "block_size", CACHE_INFO)
            out[s.label("engine") or ""] = blocks * size if blocks and size else None
            # The block size matters only to an engine that shares prompt blocks.
            caching = (s.label("enable_prefix_caching") or "").lower() == "true"
            sizes.add(size if caching else None)
        self._capacity_key, self._capacity_memo = key, out
        # One block size for the node (its engines agree and cache prefixes), else none.
        self._block_size = sizes.pop() if len(sizes) == 1 else None
        return out

    def _latency(self, found: Mapping[str, list[Series]]) -> float | None:
        sums = optional(found, ITL_SUM, ITL_SUM_OLD)
        counts = optional(found, ITL_COUNT, ITL_COUNT_OLD)
        if not sums or not counts:
            return None
        return self._itl.update(
            non_negative(total(sums), ITL_SUM), non_negative(total(counts), ITL_COUNT)
        )

    @staticmethod
    def _counter(found: Mapping[str, list[Series]], name: str) -> float | None:
        series = optional(found, name)
        return non_negative(total(series), name) if series else None

    @staticmethod
    def _preemptions(found: Mapping[str, list[Series]]) -> float | None:
        series = optional(found, PREEMPTIONS)
        return non_negative(total(series), PREEMPTIONS) if series else None

    async def abort(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        request_id: str,
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """POST the engine-side ids of `request_id` (the X-Request-Id kvgate sent).

        vLLM turns X-Request-Id `abc` into `chatcmpl-abc` for chat and `cmpl-abc-0` for
        completions; `endpoint` ("chat", "completions" or the request path) picks one,
        anything else sends both.
        Only servers started with `--enable-scale-out` have this API (403 otherwise):
        the first refusal is remembered and later calls return False at once.
        """
        url = base_url.rstrip("/") + ABORT_PATH
        ids = vllm_engine_ids(request_id, endpoint)
        return await self._post_abort(session, url, {"request_ids": ids}, headers)


def vllm_engine_ids(request_id: str, endpoint: str | None) -> list[str]:
    """The ids vLLM gives a request whose X-Request-Id header was `request_id`.

    `endpoint` may be "chat" / "completions" or the request path
    ("/v1/chat/completions", "/v1/completions"); anything else (None, "/v1/*") gets
    both candidate ids, since aborting an id that does not exist is harmless.
    """
    path = (endpoint or "").strip("/")
    if path in ("chat", "v1/chat/completions"):
        return [f"chatcmpl-{request_id}"]
    if path in ("completions", "v1/completions"):
        return [f"cmpl-{request_id}-0"]
    return [f"chatcmpl-{request_id}", f"cmpl-{request_id}-0"]
