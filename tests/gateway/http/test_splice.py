"""Spliced streams: under kvgate's HTTP/1.1 protocol, an engine's SSE bytes are written to
the client from the upstream socket's callback.

What must hold is what holds for the relay loop: the same bytes, the same counts, the same
back-pressure (`test_relay.py`) and cancellation (`test_cancellation.py`), which run on this
path too. These tests check that the path is taken when it can be, that
it is not taken when it cannot, and that a fault inside it ends the response cleanly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.helpers import RawClient
from kvgate.gateway.http.h1client import H1Response
from kvgate.gateway.http.splice import ClientWriter
from kvgate.testing import FakeEngine

BODY = {"model": "fake-model", "prompt": "hi", "stream": True, "fake": {"chunks": 50}}


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the relay took each path for a stream: `splice` once, or `readany` per read
    (the scraper's reads of metrics pages are not counted)."""
    counts = {"splice": 0, "readany": 0}

    def counted(name: str) -> Callable[..., Any]:
        original = getattr(H1Response, name)

        def wrapper(self: H1Response, *args: Any) -> Any:
            if self.content_type.startswith("text/event-stream"):
                counts[name] += 1
            return original(self, *args)

        return wrapper

    for name in counts:
        monkeypatch.setattr(H1Response, name, counted(name))
    return counts


async def _stream(url: str) -> bytes:
    async with httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/completions", json=BODY) as response:
            assert response.status_code == 200
            return b"".join([chunk async for chunk in response.aiter_raw()])


async def test_uvicorn_with_the_native_client_splices(
    fake_engine: FakeEngine, gateway_factory, reads: dict[str, int]
) -> None:
    gw = await gateway_factory([fake_engine.url])
    direct = await _stream(fake_engine.url)
    assert await _stream(gw.url) == direct
    assert reads == {"splice": 1, "readany": 0}


@pytest.mark.parametrize("server", ["hypercorn"])
async def test_other_servers_keep_the_relay_loop(
    fake_engine: FakeEngine, gateway_factory, reads: dict[str, int], server: str
) -> None:
    gw = await gateway_factory([fake_engine.url], server=server)
    direct = await _stream(fake_engine.url)
    assert await _stream(gw.url) == direct
    assert reads["splice"] == 0 and reads["readany"] > 1


async def test_a_pipelined_stream_falls_back_and_both_complete(
    fake_engine: FakeEngine, gateway_factory, reads: dict[str, int]
) -> None:
    """The first of two requests written at once is no longer uvicorn's current cycle when
    its stream starts: it must use the loop; the second, current by then, is spliced."""
    gw = await gateway_factory([fake_engine.url])
    data = orjson.dumps({**BODY, "fake": {"chunks": 30, "interval": 0.005}})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(data), data)
    )
    client = await RawClient.post(gw.url, "/v1/completions", {**BODY, "fake": {"chunks": 30}})
    client.writer.write(request)
    await client.read_until(b"\r\n0\r\n\r\n", count=2, within=10.0)
    assert client.received.count(b"HTTP/1.1 200") == 2
    assert client.received.count(b"data: [DONE]") == 2
    assert client.received.count(b"data: ") == 2 * 32  # 30 tokens, usage, [DONE] each
    assert reads["splice"] == 1 and reads["readany"] > 1
    client.drop()


async def test_a_fault_inside_the_splice_ends_the_response_and_frees_everything(
    fake_engine: FakeEngine, gateway_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay callback runs inside the upstream socket's callback: an error there (here
    the admission core's token accounting) must end this response, close the engine's
    request and release the ticket (the fixture checks), never wedge the connection or the
    parser."""
    gw = await gateway_factory([fake_engine.url])
    admission = gw.gateway.admission
    calls = 0
    original = admission.on_tokens

    def failing(ticket: Any, tokens: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("accounting fault")
        original(ticket, tokens)

    monkeypatch.setattr(admission, "on_tokens", failing)
    body = {**BODY, "fake": {"chunks": 500, "interval": 0.01}}
    client = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "faulty"})
    received = await client.read_all(within=5.0)  # the gateway closes: no hang
    assert received.startswith(b"HTTP/1.1 200")
    assert not received.endswith(b"\r\n0\r\n\r\n")  # cut short, not passed off as complete
    await fake_engine.wait_closed("faulty", within=3.0)
    assert fake_engine.by_id("faulty").chunks_sent < 500


async def test_events_that_arrive_together_leave_in_one_write(
    fake_engine: FakeEngine, gateway_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httptools reports each HTTP chunk of the engine (one per event) separately; the
    splice hands the client one write per socket read, as the relay loop's `readany()` did.
    The fake engine writes its 200 events without pausing, so they arrive in a few reads."""
    writes: list[int] = []
    original = ClientWriter.write

    def counted(self: ClientWriter, data: bytes) -> bool:
        writes.append(data.count(b"data: "))
        return original(self, data)

    monkeypatch.setattr(ClientWriter, "write", counted)
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        body = {**BODY, "fake": {"chunks": 200}}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            relayed = await response.aread()
    assert relayed.count(b"data: ") == sum(writes) == 202
    assert len(writes) <= 20
