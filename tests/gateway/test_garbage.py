"""Requests leave no reference cycles behind: their objects are freed by reference counting.

A cycle (a closure that refers to itself, a protocol and the parser that calls it back, a
response and the callback that holds it) keeps a request's whole graph alive (its body,
its exchange record, the server's cycle, the task) until the cyclic garbage collector
runs. A gateway relaying thousands of requests a second would then collect more often and
longer, and every collection stalls the event loop for all requests in flight.
"""

from __future__ import annotations

import asyncio
import gc

import httpx

from gateway.helpers import RawClient
from kvgate.testing import FakeEngine, eventually

STREAM = {"model": "fake-model", "prompt": "hi", "stream": True, "fake": {"chunks": 20}}
WHOLE = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "fake": {"chunks": 3}}


def _ours(garbage: list[object]) -> list[str]:
    names = (f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage)
    return sorted({n for n in names if n.startswith(("kvgate.", "uvicorn."))})


async def test_streams_whole_answers_and_dropped_clients_leave_no_cycles(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.post("/v1/completions", json=WHOLE)  # warm: catalog, pools
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            for _ in range(3):
                async with client.stream("POST", "/v1/completions", json=STREAM) as response:
                    await response.aread()
                assert (await client.post("/v1/completions", json=WHOLE)).status_code == 200
        body = {**STREAM, "fake": {"chunks": 500, "interval": 0.01}}
        dropped = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "gone"})
        await dropped.read_until(b"data: ", count=3)
        dropped.drop()
        await fake_engine.wait_closed("gone", within=3.0)
        assert await eventually(lambda: gw.in_flight == 0, 3.0)
        await asyncio.sleep(0.05)  # the closed connections' callbacks run
        gc.collect()
        ours = _ours(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == []
