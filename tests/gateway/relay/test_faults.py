"""Upstream faults: retry before the first byte, SSE error after it, timeouts, never a trace."""

from __future__ import annotations

import time

import httpx
import orjson

from gateway.helpers import openai_error
from kvgate.testing import FakeEngine, eventually


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


async def test_crash_mid_stream_ends_with_an_sse_error_event(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 10, "crash_after": 3}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            raw = b"".join([c async for c in response.aiter_raw()])  # ends cleanly
    events = _events(raw)
    assert len(events) == 4
    assert all(e.startswith(b"data: {") for e in events[:3])
    assert events[3].startswith(b"event: error\ndata: ")
    error = orjson.loads(events[3].split(b"data: ", 1)[1])["error"]
    assert error["code"] == "upstream_error" and error["type"] == "upstream_error"
    assert gw.gateway.metrics.upstream_errors[f"127.0.0.1:{fake_engine.port}", "reset"] == 1


async def test_hang_mid_stream_hits_the_read_timeout(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url], overrides={"upstream.read_timeout_s": 0.3})
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 10, "hang_after": 2}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"x-request-id": "hang-1"}
        ) as response:
            raw = b"".join([c async for c in response.aiter_raw()])
    events = _events(raw)
    assert len(events) == 3 and events[2].startswith(b"event: error\n")
    assert b'"upstream_timeout"' in events[2]
    await fake_engine.wait_closed("hang-1")  # the hung upstream request was closed too


async def test_first_byte_timeout_is_a_504(fake_engine: FakeEngine, gateway_factory) -> None:
    """No headers within ten read timeouts (0.5 s here) is a 504; a slower engine that does
    answer within them is waited for, longer than one read timeout."""
    gw = await gateway_factory([fake_engine.url], overrides={"upstream.read_timeout_s": 0.05})
    slow = {"model": "fake-model", "prompt": "p", "fake": {"delay": 5}}
    late = {"model": "fake-model", "prompt": "p", "fake": {"delay": 0.2}}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        started = time.monotonic()
        response = await client.post(
            "/v1/completions", json=slow, headers={"x-request-id": "slow-1"}
        )
        took = time.monotonic() - started
        answered = await client.post("/v1/completions", json=late)
    assert response.status_code == 504 and 0.5 <= took < 4.0
    error = openai_error(response.content)
    assert error["code"] == "upstream_timeout" and "did not answer in time" in error["message"]
    await fake_engine.wait_closed("slow-1")
    assert answered.status_code == 200


async def test_refused_backend_is_retried_once_on_another(engine_factory, gateway_factory) -> None:
    dead = await engine_factory()
    alive = await engine_factory()
    gw = await gateway_factory([dead.url, alive.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.get("/v1/models")  # both engines answered: both serve fake-model
        await dead.stop()  # now it refuses connections, but the catalog still lists it
        statuses = [
            (
                await client.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
            ).status_code
            for _ in range(6)
        ]
    assert statuses == [200] * 6
    assert len(alive.completions()) == 6
    assert gw.gateway.metrics.retries >= 1


async def test_no_backend_left_is_a_503_with_retry_after(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.get("/v1/models")
        await fake_engine.stop()
        response = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "p", "stream": True}
        )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert openai_error(response.content)["code"] == "upstream_unavailable"


async def test_unreachable_cluster_answers_503_not_a_trace(
    refused_url: str, gateway_factory
) -> None:
    gw = await gateway_factory([refused_url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "p"})
        ready = await client.get("/readyz")
    assert response.status_code == 503
    assert openai_error(response.content)["code"] == "no_backend"
    assert ready.status_code == 503 and ready.json()["ready"] is False


async def test_readyz_follows_the_scraper(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def ready() -> bool:
            return (await client.get("/readyz")).status_code == 200

        assert await eventually(lambda: gw.gateway.state()["policy"]["nodes"][
            f"127.0.0.1:{fake_engine.port}"]["fresh"], 3.0)  # fmt: skip
        assert await ready()
        health = await client.get("/healthz")
    assert health.status_code == 200
