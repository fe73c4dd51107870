"""A busy engine is not a dead engine: with its metrics page answering in 150 ms, 400 ms or
1.5 s while it serves tokens normally, kvgate (default `adaptive` policy, default scrape
interval and staleness) serves light traffic without a 503, and at high KV it sheds with
429, never 503. The node's states are recorded all along."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import httpx
import pytest

from kvgate.testing import FakeEngine, eventually

pytestmark = pytest.mark.timeout(120)

STREAM = {"model": "fake-model", "prompt": "hi", "max_tokens": 8, "stream": True,
          "fake": {"chunks": 8, "interval": 0.03}}  # fmt: skip


async def _client(client: httpx.AsyncClient, until: float, statuses: Counter[int]) -> None:
    """One user: streamed requests one after another, a short pause between them."""
    while time.monotonic() < until:
        async with client.stream("POST", "/v1/completions", json=STREAM) as response:
            await response.aread()
            statuses[response.status_code] += 1
        await asyncio.sleep(0.05)


async def _record_states(gw, node: str, states: Counter[str]) -> None:  # type: ignore[no-untyped-def]
    while True:
        snapshot = gw.gateway.admission.snapshot()["nodes"].get(node)
        if snapshot is not None:
            states[snapshot["state"]] += 1
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("delay", [0.15, 0.4, 1.5], ids=["150ms", "400ms", "1500ms"])
async def test_a_slow_metrics_page_does_not_take_a_serving_engine_out(
    gateway_factory, delay: float
) -> None:
    engine = await FakeEngine(metrics_delay=delay).start()
    try:
        gw = await gateway_factory(
            [engine.url],
            policy="adaptive",
            overrides={"scrape.interval_s": 0.05},
        )
        node = f"127.0.0.1:{engine.port}"
        policy = gw.gateway.admission.policy
        assert await eventually(lambda: node in policy.nodes and policy.nodes[node].sample, 10)
        states: Counter[str] = Counter()
        recorder = asyncio.create_task(_record_states(gw, node, states))
        try:
            # Light traffic: two users for 4 s, whatever the page does.
            statuses: Counter[int] = Counter()
            until = time.monotonic() + 4.0
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                await asyncio.gather(*(_client(client, until, statuses) for _ in range(2)))
            assert set(statuses) == {200}, statuses
            assert sum(statuses.values()) >= 10
            assert not states.keys() & {"stale", "dead", "unknown"}, states
            if delay > 1.0:  # slower than stale_after_s: served because its tokens flow
                assert states["lagging"] > 0, states

            # High KV while a long stream admitted before still flows: shed with 429.
            long = {**STREAM, "fake": {"chunks": 200, "interval": 0.03}}
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                stream = asyncio.create_task(client.post("/v1/completions", json=long))
                assert await eventually(lambda: policy.in_flight_requests == 1, 5)
                engine.kv_usage = 0.97
                assert await eventually(
                    lambda: (
                        (sample := policy.nodes[node].sample) is not None
                        and sample.kv_usage == 0.97
                    ),
                    10,
                )
                shed: Counter[tuple[int, str | None]] = Counter()
                for _ in range(20):
                    response = await client.post("/v1/completions", json=STREAM)
                    shed[response.status_code, response.headers.get("x-kvgate-reason")] += 1
                    await asyncio.sleep(0.05)
                assert (await stream).status_code == 200
            assert set(shed) == {(429, "kv_panic")}, shed
            assert not states.keys() & {"stale", "dead", "unknown"}, states
        finally:
            recorder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recorder
        scrape = gw.gateway.scraper.snapshot()["nodes"][node]
        assert scrape["failures_total"] == 0, scrape  # slow is not failed
        assert scrape["last_latency_s"] >= delay * 0.95
    finally:
        await engine.stop()
