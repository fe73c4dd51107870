"""Graceful shutdown: drain in-flight streams, then cancel the rest upstream too."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.helpers import RawClient, access_lines, kvgate_serve, until_ready
from kvgate.testing import FakeEngine


async def test_stop_lets_streams_finish_within_the_drain(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url], overrides={"server.drain_timeout_s": 5})
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 10, "interval": 0.03}}  # fmt: skip
    client = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "drain-1"})
    await client.read_until(b"data: ", count=2)
    gw.server.stop()
    raw = await client.read_all(within=5.0)
    await asyncio.wait_for(gw.task, 5)
    assert raw.count(b"data: ") == 12 and b"data: [DONE]" in raw
    assert fake_engine.by_id("drain-1").closed_by_client_at is None


async def test_drain_timeout_cancels_upstream_and_tells_the_client(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url], overrides={"server.drain_timeout_s": 0.3})
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 1000, "interval": 0.02}}  # fmt: skip
    client = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "drain-2"})
    await client.read_until(b"data: ", count=2)
    stopped = time.monotonic()
    gw.server.stop()
    raw = await client.read_all(within=5.0)
    seen = await fake_engine.wait_closed("drain-2", within=3.0)
    await asyncio.wait_for(gw.task, 5)
    assert 0.25 < seen.closed_by_client_at - stopped < 2.0
    # the error event is the last thing sent, then the chunked body ends cleanly
    _, error = raw.split(b"event: error\ndata: ", 1)
    assert b'"code":"shutting_down"' in error and b"cmpl-1" not in error
    assert raw.endswith(b"\r\n0\r\n\r\n")


@pytest.mark.timeout(60)
async def test_kvgate_serve_relays_and_exits_cleanly_on_sigterm(fake_engine: FakeEngine) -> None:
    async with kvgate_serve("--backend", fake_engine.url) as served:
        async with httpx.AsyncClient(base_url=served.url) as client:
            assert await until_ready(client), "kvgate serve never became ready"
            response = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "p"},
                headers={"x-request-id": "cli-1"},
            )  # fmt: skip
        assert response.status_code == 200
    stderr = served.stderr
    assert served.returncode == 0, stderr.decode()
    assert [line["id"] for line in access_lines(stderr)] == ["cli-1"]
    assert b"Traceback" not in stderr


@pytest.mark.timeout(90)
async def test_kvgate_serve_without_backend_runs_the_simulator(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The README quick start: `kvgate serve` alone fronts two simulated engines."""
    async with kvgate_serve(cwd=tmp_path, stop_within=20.0) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            ready = await until_ready(client, within=30.0)
            assert ready, "kvgate serve with the simulator never became ready"
            models = (await client.get("/v1/models")).json()["data"]
            response = await client.post(
                "/v1/completions", json={"model": models[0]["id"], "prompt": "hi", "max_tokens": 4}
            )
            state = (await client.get("/admin/state")).json()
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 4
        assert len(state["gateway"]["backends"]) == 2
    assert served.returncode == 0, served.stderr.decode()
    assert b"started the built-in simulator" in served.stderr
    assert b"Traceback" not in served.stderr


async def test_hypercorn_drains_and_cancels_too(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory(
        [fake_engine.url],
        server="hypercorn",
        overrides={"server.drain_timeout_s": 0.3},
    )
    short = {"model": "fake-model", "prompt": "p", "stream": True,
             "fake": {"chunks": 5, "interval": 0.03}}  # fmt: skip
    long = {**short, "fake": {"chunks": 1000, "interval": 0.02}}
    finishing = await RawClient.post(gw.url, "/v1/completions", short, {"x-request-id": "h-ok"})
    doomed = await RawClient.post(gw.url, "/v1/completions", long, {"x-request-id": "h-cut"})
    await finishing.read_until(b"data: ")
    await doomed.read_until(b"data: ")
    gw.server.stop()
    done, _ = await finishing.count_to_end(b"data: ", within=5.0)
    cut, tail = await doomed.count_to_end(b"data: ", within=5.0)
    await fake_engine.wait_closed("h-cut", within=3.0)
    await asyncio.wait_for(gw.task, 10)
    assert done == 7  # 5 tokens, usage, [DONE]: finished inside the drain
    assert cut < 1000 and b'"code":"shutting_down"' in tail  # the final SSE error event
