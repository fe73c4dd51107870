"""Engines that fail: stale or garbage metrics, hangs and crashes mid-stream, comebacks.

Real servers only: simulated vLLM engines (`kvgate.sim`) behind `kvgate.testing.chaos`
fronts, the real gateway with the adaptive policy, httpx clients. Every test ends with the
gateway's books at zero (the `gateway_factory` fixture checks in-flight and tickets; the
tests check reserved tokens per node too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from kvgate.core.nodes import LAG_LIMIT_FACTOR
from kvgate.sim.presets import get_preset
from kvgate.testing import eventually
from kvgate.testing.chaos import ChaosNode

MODEL = "sim-llama"


@pytest.fixture
async def nodes() -> AsyncIterator[list[ChaosNode]]:
    started = [await ChaosNode(get_preset("cpu-tiny"), seed=i).start() for i in range(2)]
    try:
        yield started
    finally:
        for node in started:
            await node.close()


async def _gateway(gateway_factory, nodes: list[ChaosNode], **overrides: Any):
    settings = {
        "backends": [
            {"url": n.url, "metrics_url": n.metrics_url, "name": f"node{i}"}
            for i, n in enumerate(nodes)
        ],
        "scrape.interval_s": 0.1,
        "admission.stale_after_s": 0.5,
        **overrides,
    }
    gw = await gateway_factory([], policy="adaptive", overrides=settings)
    assert await eventually(lambda: _fresh(gw) == {"node0", "node1"}, 5.0)
    return gw


def _fresh(gw) -> set[str]:
    nodes = gw.gateway.admission.snapshot()["nodes"]
    return {nid for nid, state in nodes.items() if state["fresh"]}


def _served(gw, node: str) -> int:
    return sum(v for (_, status, backend), v in gw.gateway.metrics.requests.items()
               if backend == node and status == "200")  # fmt: skip


def _assert_books_empty(gw) -> None:
    snap = gw.gateway.admission.snapshot()
    assert snap["in_flight_requests"] == 0 and snap["queue"]["waiting"] == 0
    assert all(state["reserved_tokens"] == 0 for state in snap["nodes"].values()), snap["nodes"]
    assert gw.gateway.metrics.in_flight == 0


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": 8, **extra}


@pytest.mark.parametrize("fault", ["hang", "garbage", "error"])
async def test_bad_metrics_node_is_routed_around_then_used_again(
    nodes: list[ChaosNode], gateway_factory, caplog, fault: str
) -> None:
    gw = await _gateway(gateway_factory, nodes)
    caplog.set_level(logging.INFO, logger="kvgate.gateway.engines.scraper")
    nodes[0].metrics_mode = fault  # type: ignore[assignment]
    assert await eventually(lambda: _fresh(gw) == {"node1"}, 3.0)
    before = _served(gw, "node0")
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        for _ in range(12):
            response = await client.post("/v1/completions", json=_body())
            assert response.status_code == 200, (response.headers, response.text)
        await asyncio.sleep(0.5)  # many more failed scrapes of node0 ...
        scrape = gw.gateway.scraper.snapshot()["nodes"]["node0"]
        if fault == "hang":  # ... or one poll waiting: stale by its sample's age alone
            assert scrape["in_flight_s"] >= 1.0, scrape
        else:
            assert scrape["failures_total"] >= 5, scrape
        assert _served(gw, "node0") == before  # ... and not one request went there
        nodes[0].metrics_mode = "ok"
        # The next poll reads it; after a hang, the hedge of the poll still waiting on its
        # lost GET does, within stale_after_s.
        assert await eventually(lambda: _fresh(gw) == {"node0", "node1"}, 3.0)
        for _ in range(40):  # the least-loaded routing sends some to node0 again
            assert (await client.post("/v1/completions", json=_body())).status_code == 200
            if _served(gw, "node0") > before:
                break
    assert _served(gw, "node0") > before
    records = [r.getMessage() for r in caplog.records if "node0" in r.getMessage()]
    failed = sum("scrape failed" in m for m in records)
    # Logged once, not per scrape. A hang answered again before its bound (5 x
    # stale_after_s) failed no scrape at all: a hedge read the page.
    assert failed == 1 or (fault == "hang" and failed == 0), records
    assert sum("recovered" in m for m in records) == failed, records
    _assert_books_empty(gw)


async def test_all_metrics_late_then_gone_waits_then_sheds_with_503_not_blind_routing(
    nodes: list[ChaosNode], gateway_factory
) -> None:
    """Every page hangs: for as long as the nodes are only late (their last samples within
    the lag limit, no hard failure) a request waits for a sample and is sent nowhere; it
    starts when a page answers again. Silent past the lag limit, they get 503s."""
    gw = await _gateway(gateway_factory, nodes)
    for node in nodes:
        node.metrics_mode = "hang"
    assert await eventually(lambda: not _fresh(gw), 3.0)
    before = {name: _served(gw, name) for name in ("node0", "node1")}
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        waiting = asyncio.create_task(client.post("/v1/completions", json=_body()))
        assert await eventually(lambda: gw.gateway.admission.snapshot()["queue"]["waiting"], 3.0)
        assert not waiting.done()
        assert {name: _served(gw, name) for name in before} == before  # sent nowhere
        for node in nodes:
            node.metrics_mode = "ok"
        assert (await waiting).status_code == 200  # served once a page answered
        for node in nodes:
            node.metrics_mode = "hang"
        lag_limit = LAG_LIMIT_FACTOR * gw.gateway.config.admission.stale_after_s
        # Past the lag limit: every node stale or dead (neither fresh, lagging nor late). Right
        # after the pages answered the nodes are fresh, hence not late either.
        assert await eventually(lambda: _states(gw) <= {"stale", "dead"}, lag_limit + 3.0)
        response = await client.post("/v1/completions", json=_body())
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"]
        for node in nodes:
            node.metrics_mode = "ok"
        assert await eventually(lambda: len(_fresh(gw)) == 2, 3.0)
        assert (await client.post("/v1/completions", json=_body())).status_code == 200
    _assert_books_empty(gw)


def _states(gw) -> set[str]:
    nodes = gw.gateway.admission.snapshot()["nodes"]
    return {"late" if state["late"] else state["state"] for state in nodes.values()}


async def _read_events(response: httpx.Response, count: int) -> list[bytes]:
    buffer = b""
    async for chunk in response.aiter_raw():
        buffer += chunk
        if buffer.count(b"\n\n") >= count:
            break
    return buffer.split(b"\n\n")


async def test_engine_hung_mid_stream_times_out_with_an_sse_error(
    nodes: list[ChaosNode], gateway_factory
) -> None:
    gw = await _gateway(gateway_factory, nodes, **{"upstream.read_timeout_s": 0.4})
    body = _body(stream=True, max_tokens=400, ignore_eos=True)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            buffer = b""
            stream = response.aiter_raw()
            while buffer.count(b"\n\n") < 2:
                buffer += await anext(stream)
            for node in nodes:  # whichever node serves it, its bytes stop now
                node.stall_some(10)
            async with asyncio.timeout(5):
                async for chunk in stream:
                    buffer += chunk
    events = [e for e in buffer.split(b"\n\n") if e]
    assert events[-1].startswith(b"event: error\ndata: ")
    error = orjson.loads(events[-1].split(b"data: ", 1)[1])["error"]
    assert error["code"] == "upstream_timeout"
    assert b"[DONE]" not in buffer
    # The hung upstream connection was closed, so the engine aborted the request.
    assert await eventually(lambda: all(n.sim.engine.num_running == 0 for n in nodes), 3.0)
    _assert_books_empty(gw)


async def test_engine_crash_mid_stream_and_before_headers(
    nodes: list[ChaosNode], gateway_factory
) -> None:
    gw = await _gateway(gateway_factory, nodes)
    body = _body(stream=True, max_tokens=400, ignore_eos=True)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            stream = response.aiter_raw()
            buffer = await anext(stream)
            served_by = [n for n in nodes if n.sim.engine.num_running]
            assert len(served_by) == 1
            await served_by[0].crash()
            async with asyncio.timeout(5):
                async for chunk in stream:
                    buffer += chunk
        assert buffer.rstrip().split(b"\n\n")[-1].startswith(b"event: error")
        # The crashed node refuses connections: requests go to the other one.
        for _ in range(6):
            response = await client.post("/v1/completions", json=_body())
            assert response.status_code == 200, response.text
        await served_by[0].restart()
        assert await eventually(lambda: len(_fresh(gw)) == 2, 3.0)
        crashed = "node0" if served_by[0] is nodes[0] else "node1"
        before = _served(gw, crashed)
        for _ in range(40):
            assert (await client.post("/v1/completions", json=_body())).status_code == 200
            if _served(gw, crashed) > before:
                break
        assert _served(gw, crashed) > before  # the node that came back is used again
    _assert_books_empty(gw)


async def test_connection_reset_before_headers_is_retried(
    nodes: list[ChaosNode], gateway_factory
) -> None:
    gw = await _gateway(gateway_factory, nodes)
    body = _body(max_tokens=300, ignore_eos=True)  # non-streaming: ~1 s of work
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        task = asyncio.create_task(client.post("/v1/completions", json=body))
        assert await eventually(lambda: sum(n.open_links for n in nodes) >= 1, 3.0)
        reset = sum(n.reset_some(5) for n in nodes)
        response = await task
    assert reset >= 1
    # Reset while waiting for the answer: nothing was sent to the client yet, so the
    # relay either retried elsewhere (200) or answered a clean 502/503.
    assert response.status_code in (200, 502, 503), response.text
    if response.status_code != 200:
        assert response.json()["error"]["code"]
    _assert_books_empty(gw)
