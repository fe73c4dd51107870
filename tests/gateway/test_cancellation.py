"""A client that goes away stops the engine: at every stage, fast, and nothing leaks.

Timings are printed (run with `-s`) and asserted with a generous bound, because the
machine is shared; `benchmarks/proxy_overhead/` measures the real figures. The design
target is the engine seeing the close within 50 ms of the client's.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from gateway.helpers import RawClient
from kvgate.testing import FakeEngine, eventually

GENEROUS_S = 0.5  # an order of magnitude above the 50 ms target, against CI noise


async def _propagation(engine: FakeEngine, client: RawClient, rid: str) -> float:
    seen = await engine.wait_closed(rid, within=3.0)
    assert client.closed_at is not None and seen.closed_by_client_at is not None
    return seen.closed_by_client_at - client.closed_at


async def _leave_mid_stream(gateway_url: str, rid: str) -> RawClient:
    """Start a 500-event stream, read 5 events, and hang up."""
    client = await RawClient.post(
        gateway_url,
        "/v1/completions",
        {"model": "fake-model", "prompt": "p", "stream": True,
         "fake": {"interval": 0.02, "chunks": 500}},
        {"x-request-id": rid},
    )  # fmt: skip
    await client.read_until(b"data: ", count=5)
    client.drop()
    return client


@pytest.mark.parametrize(
    ("stage", "body"),
    [
        # the engine delays its response headers: the gateway waits in `open()`
        ("before_headers", {"stream": True, "fake": {"delay": 5, "chunks": 3}}),
        # headers sent, the first token takes long
        ("before_first_token", {"stream": True, "fake": {"interval": 5, "chunks": 3}}),
        # the gateway waits for a non-streaming answer
        ("non_streaming_wait", {"stream": False, "fake": {"interval": 1, "chunks": 50}}),
    ],
)
async def test_disconnect_while_waiting_reaches_the_engine(
    fake_engine: FakeEngine, gateway_factory, stage: str, body: dict
) -> None:
    gw = await gateway_factory([fake_engine.url])
    rid = f"cancel-{stage}"
    client = await RawClient.post(
        gw.url, "/v1/completions", {"model": "fake-model", "prompt": "p", **body},
        {"x-request-id": rid},
    )  # fmt: skip
    if stage == "before_first_token":
        await client.read_until(b"\r\n\r\n")
    else:  # the request is upstream, the engine is busy with it
        assert await eventually(lambda: any(r.request_id == rid for r in fake_engine.requests))
    assert fake_engine.by_id(rid).closed_by_client_at is None
    client.drop()
    took = await _propagation(fake_engine, client, rid)
    print(f"\n{stage}: engine saw the close {took * 1000:.2f} ms after the client")
    assert took < GENEROUS_S
    assert fake_engine.by_id(rid).chunks_sent == 0
    assert sum(gw.gateway.metrics.cancellations.values()) == 1


async def test_disconnect_mid_stream_stops_the_tokens(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    rid = "cancel-mid-stream"
    client = await _leave_mid_stream(gw.url, rid)
    took = await _propagation(fake_engine, client, rid)
    sent_at_close = fake_engine.by_id(rid).chunks_sent
    # Once the engine has stopped handling the request its count is final.
    assert await eventually(lambda: fake_engine.by_id(rid).handled_at is not None)
    print(f"\nmid_stream: engine saw the close {took * 1000:.2f} ms after the client")
    assert took < GENEROUS_S
    assert fake_engine.by_id(rid).chunks_sent == sent_at_close < 500  # no further tokens
    assert gw.gateway.metrics.cancellations == {"streaming": 1}
    assert b"kvgate_cancel_propagation_seconds_count 1.0" in gw.gateway.metrics.render()


async def test_many_concurrent_disconnects_leave_nothing_behind(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    clients = []
    for i in range(20):
        stream = i % 2 == 0
        body = {"model": "fake-model", "prompt": "p", "stream": stream,
                "fake": {"interval": 0.05, "chunks": 200}}  # fmt: skip
        clients.append(
            await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": f"many-{i}"})
        )
    assert await eventually(lambda: gw.in_flight == 20)
    for client in clients:
        client.drop()
    for i in range(20):
        await fake_engine.wait_closed(f"many-{i}", within=3.0)
    # the gateway fixture asserts in-flight 0 and no unreleased ticket afterwards


async def test_sglang_requests_carry_the_id_its_abort_api_names(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """SGLang aborts by the `rid` a request carried: the gateway puts its id there, and a
    client that leaves gets exactly that id aborted (besides the closed connection)."""
    backends = [{"url": fake_engine.url, "engine": "sglang"}]
    gw = await gateway_factory([], overrides={"backends": backends})
    rid = "cancel-sglang"
    client = await RawClient.post(
        gw.url,
        "/v1/completions",
        {"model": "fake-model", "prompt": "p", "stream": True, "rid": "the-clients-own",
         "fake": {"interval": 0.02, "chunks": 500}},
        {"x-request-id": rid},
    )  # fmt: skip
    await client.read_until(b"data: ", count=3)
    assert fake_engine.by_id(rid).json["rid"] == rid
    client.drop()
    await fake_engine.wait_closed(rid, within=3.0)

    def aborted() -> list[object]:
        return [r.json for r in fake_engine.requests if r.path == "/abort_request"]

    assert await eventually(lambda: aborted() == [{"rid": rid}], 3.0), aborted()
    (abort,) = [r for r in fake_engine.requests if r.path == "/abort_request"]
    assert abort.headers["content-type"] == "application/json"


async def test_vllm_requests_are_relayed_without_an_id_field(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient() as http:
        response = await http.post(
            gw.url + "/v1/completions",
            json={"model": "fake-model", "prompt": "p", "max_tokens": 3},
            headers={"x-request-id": "plain-vllm"},
        )
    assert response.status_code == 200
    assert "rid" not in fake_engine.by_id("plain-vllm").json


async def test_a_client_that_leaves_mid_stream_is_counted_with_what_it_was_sent(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """The relay's own account of a departed stream: the events it had relayed before the
    client left (at most what the engine sent), none read from upstream afterwards, and the
    same numbers on `/metrics`, so a benchmark can tell unread tokens from zombie tokens."""
    gw = await gateway_factory([fake_engine.url])
    rid = "gone-mid-stream"
    client = await _leave_mid_stream(gw.url, rid)
    await _propagation(fake_engine, client, rid)
    sent = fake_engine.by_id(rid).chunks_sent
    m = gw.gateway.metrics
    assert await eventually(lambda: m.client_gone_streams == 1)
    assert 5 <= m.client_gone_events <= sent < 500
    assert m.events_after_client_gone == 0
    page = m.render()
    assert b"kvgate_client_gone_streams_total 1.0" in page
    assert f"kvgate_client_gone_stream_events_total {m.client_gone_events}.0".encode() in page
    assert b"kvgate_events_after_client_gone_total 0.0" in page


async def test_a_stream_read_to_its_end_is_not_counted_as_gone(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        body = {"model": "fake-model", "prompt": "p", "stream": True, "fake": {"chunks": 20}}
        resp = await http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.text.count("data: ") >= 20
    m = gw.gateway.metrics
    assert (m.client_gone_streams, m.client_gone_events) == (0, 0)


async def _engine_slow_to_end(request: web.Request) -> web.StreamResponse:
    """An engine that sends `[DONE]` and only ends the response a while later."""
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": "slow-end"}]})
    if request.path == "/metrics":
        return web.Response(text="")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i)
    await resp.write(b"data: [DONE]\n\n")
    await asyncio.sleep(1.0)
    return resp


async def test_a_client_that_closes_right_after_done_is_not_counted_as_gone(
    gateway_factory,
) -> None:
    """Clients often close as soon as they read `[DONE]`, before the relay has ended the
    response: they lost nothing, so they are not counted as departed streams."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", _engine_slow_to_end)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        engine = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = await gateway_factory([engine])
        client = await RawClient.post(
            gw.url, "/v1/completions", {"model": "slow-end", "prompt": "p", "stream": True}, {}
        )
        await client.read_until(b"[DONE]")
        client.drop()
        m = gw.gateway.metrics
        assert await eventually(lambda: m.in_flight == 0)
        assert m.cancellations == {"streaming": 1}  # the relay did see the client leave
        assert (m.client_gone_streams, m.client_gone_events) == (0, 0)
    finally:
        await runner.cleanup()
