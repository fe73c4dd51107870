"""kvgate's HTTP/1.1 protocol tells the relay of a lost client directly, without a task.

The watcher-task path (any other ASGI server) is covered by the HTTP/2 tests, which run
under hypercorn; the cancellation tests cover every stage on the direct path.
"""

from __future__ import annotations

import asyncio

import orjson

from gateway.helpers import RawClient
from kvgate.gateway.http.disconnect import DisconnectSignal
from kvgate.testing import FakeEngine, eventually


def _watchers() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "watch_disconnect"]


async def _streaming(gateway_url: str, rid: str) -> RawClient:
    """A 500-event stream, 3 events read: the relay is mid-stream, the client still there."""
    client = await RawClient.post(
        gateway_url, "/v1/completions",
        {"model": "fake-model", "prompt": "p", "stream": True,
         "fake": {"interval": 0.02, "chunks": 500}},
        {"x-request-id": rid},
    )  # fmt: skip
    await client.read_until(b"data: ", count=3)
    return client


def test_signal_fires_once_and_only_for_a_subscriber() -> None:
    calls: list[str] = []
    signal = DisconnectSignal()
    signal.subscribe(lambda: calls.append("a"))
    signal.fire()
    signal.fire()
    assert calls == ["a"] and signal.lost

    late = DisconnectSignal()
    late.fire()
    late.subscribe(lambda: calls.append("late"))  # already gone: told at once
    assert calls == ["a", "late"]

    left = DisconnectSignal()
    left.subscribe(lambda: calls.append("never"))
    left.unsubscribe()  # the request ended before its client left
    left.fire()
    assert calls == ["a", "late"]


async def test_uvicorn_relay_runs_no_watcher_task_and_still_stops_the_engine(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    rid = "signal-mid-stream"
    client = await _streaming(gw.url, rid)
    assert gw.in_flight == 1 and _watchers() == []
    client.drop()
    seen = await fake_engine.wait_closed(rid, within=3.0)
    assert client.closed_at is not None and seen.closed_by_client_at is not None
    assert seen.closed_by_client_at - client.closed_at < 0.5
    assert gw.gateway.metrics.cancellations == {"streaming": 1}


async def test_hypercorn_relay_watches_with_a_task(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url], server="hypercorn")
    rid = "watcher-mid-stream"
    client = await _streaming(gw.url, rid)
    assert len(_watchers()) == 1
    client.drop()
    await fake_engine.wait_closed(rid, within=3.0)
    assert await eventually(lambda: _watchers() == [], 2.0)


async def test_pipelined_requests_all_end_when_the_connection_drops(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """Two requests written back to back on one connection: the second waits in uvicorn's
    pipeline while the first streams. Dropping the connection ends both; nothing leaks
    (the fixture checks in-flight requests and tickets afterwards)."""
    gw = await gateway_factory([fake_engine.url])
    first = {"model": "fake-model", "prompt": "p", "stream": True,
             "fake": {"interval": 0.02, "chunks": 500}}  # fmt: skip
    second = {"model": "fake-model", "prompt": "p", "stream": False,
              "fake": {"interval": 0.02, "chunks": 500}}  # fmt: skip
    client = await RawClient.post(gw.url, "/v1/completions", first, {"x-request-id": "pipe-1"})
    data = orjson.dumps(second)
    client.writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: pipe-2\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)
    )
    await client.read_until(b"data: ", count=3)
    client.drop()
    await fake_engine.wait_closed("pipe-1", within=3.0)
    assert await eventually(lambda: gw.in_flight == 0, 3.0)
    second_sent = [r for r in fake_engine.requests if r.request_id == "pipe-2"]
    # Either uvicorn never started it, or the engine saw it closed too.
    for request in second_sent:
        await fake_engine.wait_closed("pipe-2", within=3.0)
        assert request.chunks_sent < 500
