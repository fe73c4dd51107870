"""What a live run reads while it plays: the engines' metrics pages and the gateway's view.

Every engine's `/metrics` is polled to record the time series (KV usage, running,
waiting, preemptions) and read before and after the run for its counters; the gateway's
`/admin/state` and `/metrics` give its queue (`kvgate.bench.gateway_queue`), its view of
the nodes, and its count of streams whose client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from typing import Any

import aiohttp
import numpy as np
import orjson

from kvgate.bench.gateway_queue import WaitHistogram, wait_histogram, waiting_now
from kvgate.bench.live.client import ClientRun, LiveTarget

# Gauges and counters read from each engine's metrics page (summed over label sets).
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:request_generation_tokens_sum",
    "vllm:request_success_total",
    "sim:zombie_tokens_total",
    "sim:recomputed_tokens_total",
)
# The gateway's own view, polled beside the engines' (see `_gateway_view`).
GATEWAY_SERIES = ("queued", "gw_blocked", "gw_thrashing", "gw_reserved", "gw_peak", "gw_iter_s")


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum each wanted metric over its label sets; cheap line scan, no full parse."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        name = line[:brace] if brace != -1 else line[:space]
        if name in wanted:
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line[space + 1 :])
    return out


async def poll_engines(
    session: aiohttp.ClientSession,
    target: LiveTarget,
    shared: ClientRun,
    step_s: float,
    series: dict[str, list[float]],
    stop: asyncio.Event,
) -> None:
    """Record cluster-wide KV usage, running, waiting and preemptions every `step_s`."""
    last_pre: float | None = None
    while not stop.is_set():
        tick = shared.now()
        pages = await asyncio.gather(*(scrape(session, e) for e in target.engines))
        kv = [p.get("vllm:kv_cache_usage_perc", math.nan) for p in pages]
        pre = sum(p.get("vllm:num_preemptions_total", 0.0) for p in pages)
        series["t"].append(tick)
        series["kv_usage_max"].append(float(np.nanmax(kv)) if kv else math.nan)
        series["kv_usage_mean"].append(float(np.nanmean(kv)) if kv else math.nan)
        series["running"].append(sum(p.get("vllm:num_requests_running", 0.0) for p in pages))
        series["waiting"].append(sum(p.get("vllm:num_requests_waiting", 0.0) for p in pages))
        series["preemptions"].append(0.0 if last_pre is None else pre - last_pre)
        view = await _gateway_view(session, target.gateway)
        for key in GATEWAY_SERIES:
            series.setdefault(key, []).append(view.get(key, math.nan))
        last_pre = pre
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, step_s - (shared.now() - tick)))


async def _admin_state(
    session: aiohttp.ClientSession, gateway: str, timeout_s: float
) -> dict[str, Any] | None:
    """The gateway's `/admin/state` as a dict; None when it did not answer with one."""
    try:
        async with session.get(
            gateway + "/admin/state", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            state = orjson.loads(await resp.read())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    return state if isinstance(state, dict) else None


async def _gateway_view(session: aiohttp.ClientSession, gateway: str | None) -> dict[str, float]:
    """The gateway's view: requests waiting in its queue (`queued`), and over its nodes
    whether any refuses everything (thrashing, stale or at panic), the tokens it holds on
    them, the highest planned peak (0-1) and the slowest iteration. Empty without a
    gateway; every key NaN when the gateway did not answer."""
    if gateway is None:
        return {}
    state = await _admin_state(session, gateway, 2.0)
    if state is None:
        return {}
    out = {"queued": waiting_now(state)}
    policy = state.get("policy") or {}
    nodes = [n for n in (policy.get("nodes") or {}).values() if isinstance(n, dict)]
    if nodes:
        out["gw_blocked"] = float(
            any(n.get("state") in ("thrashing", "stale", "unknown", "panic") for n in nodes)
        )
        out["gw_thrashing"] = float(any(n.get("state") == "thrashing" for n in nodes))
        out["gw_reserved"] = float(sum(n.get("reserved_tokens") or 0.0 for n in nodes))
        peaks = [float(p) for n in nodes if isinstance(p := n.get("peak_usage"), int | float)]
        out["gw_peak"] = max(peaks, default=math.nan)
        iters = [(n.get("sample") or {}).get("iteration_latency_s") for n in nodes]
        out["gw_iter_s"] = max((float(x) for x in iters if x is not None), default=math.nan)
    return out


async def queue_marks(
    session: aiohttp.ClientSession, gateway: str | None
) -> tuple[dict[str, Any] | None, WaitHistogram]:
    """The gateway's state and its queue-wait histogram, read once (None and empty when
    there is no gateway or it did not answer)."""
    if gateway is None:
        return None, WaitHistogram()
    state = await _admin_state(session, gateway, 5.0)
    try:
        async with session.get(
            gateway + "/metrics", timeout=aiohttp.ClientTimeout(total=5.0)
        ) as resp:
            waits = wait_histogram(await resp.text())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        waits = WaitHistogram()
    return state, waits


async def scrape(session: aiohttp.ClientSession, engine: str) -> dict[str, float]:
    try:
        async with session.get(
            engine + "/metrics", timeout=aiohttp.ClientTimeout(total=2.0)
        ) as resp:
            return parse_metrics(await resp.text(), GAUGES + COUNTERS)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return {}


def relay_counters(state: dict[str, Any] | None) -> dict[str, int]:
    """The gateway's count of streams whose client left (`kvgate_client_gone_*`), if any."""
    if state is None:
        return {}
    counters = state.get("gateway") or {}
    keys = ("client_gone_streams", "client_gone_events", "events_after_client_gone")
    return {k: int(counters[k]) for k in keys if isinstance(counters.get(k), int)}
