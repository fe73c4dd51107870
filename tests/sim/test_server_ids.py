"""Engine ids of the live simulator: a reused X-Request-Id never inherits a namesake's end.

kvgate resends a request on a fresh connection with the same X-Request-Id when the first
connection was reset before any answer came (the engine may have seen it). The dropped
predecessor's abort is applied when a step begins and reported when that step ends; a
successor that arrived in between must not be told "aborted by the engine" (seen in the
chaos soak). Steps are slowed 50x (`time_scale`) so that window is ~150 ms wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest

from kvgate.sim.model.engine import Engine, EngineConfig
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer

pytestmark = pytest.mark.timeout(30)

SLOW = 50.0  # real seconds per engine second: a cpu-tiny step takes ~150 ms
Spawn = Callable[[str, dict[str, object]], "asyncio.Task[httpx.Response]"]


@contextlib.asynccontextmanager
async def _server(
    config: EngineConfig = CPU_TINY, time_scale: float = 1.0
) -> AsyncIterator[tuple[SimServer, httpx.AsyncClient, Spawn]]:
    """A started simulator, a client for it, and a way to send completions in the
    background; whatever is still running at the end is cancelled, then the server closed."""
    sim = SimServer(Engine(config, seed=0), model_name="sim-llama", time_scale=time_scale)
    await sim.start("127.0.0.1", 0)
    tasks: list[asyncio.Task[httpx.Response]] = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim.port}", timeout=20) as http:

            def spawn(request_id: str, body: dict[str, object]) -> asyncio.Task[httpx.Response]:
                headers = {"X-Request-Id": request_id}
                tasks.append(
                    asyncio.create_task(http.post("/v1/completions", json=body, headers=headers))
                )
                return tasks[-1]

            try:
                yield sim, http, spawn
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await sim.close()


async def _until(check: Callable[[], bool], within_s: float = 10.0) -> None:
    """Poll `check()` every millisecond until it is true (fails the test after `within_s`)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not check():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


async def _raw_post(port: int, request_id: str, body: dict[str, object]) -> asyncio.StreamWriter:
    """Send a non-streamed completion on a connection of our own (so we can reset it)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (request_id.encode(), len(data), data)
    )
    await writer.drain()
    return writer


async def _successor_during_the_abort_step(
    sim: SimServer, http: httpx.AsyncClient, engine_id: str
) -> httpx.Response:
    """Wait until the predecessor's abort was applied by a step still in flight, then send
    its successor with the same X-Request-Id and return the successor's answer."""
    await _until(lambda: engine_id not in sim.engine and sim.engine.in_flight)
    return await http.post(
        "/v1/completions",
        json={"prompt": "again", "max_tokens": 3, "ignore_eos": True},
        headers={"X-Request-Id": "same"},
    )


LONG = {"prompt": "x", "max_tokens": 400, "ignore_eos": True}


async def test_retry_after_a_reset_connection_is_not_aborted_by_the_predecessor() -> None:
    async with _server(time_scale=SLOW) as (sim, http, spawn):
        spawn("bg", LONG)  # keeps every step non-empty (an abort-only step takes no time)
        assert sim.port is not None
        first = await _raw_post(sim.port, "same", LONG)
        await _until(lambda: sim.engine.output_tokens("cmpl-same-0") > 0)
        first.transport.abort()  # the connection reset: the engine aborts at the next step
        retry = await _successor_during_the_abort_step(sim, http, "cmpl-same-0")
        assert retry.status_code == 200, retry.text
        assert retry.json()["usage"]["completion_tokens"] == 3
        assert sim.open_requests == 1  # the background request: both namesakes were freed


async def test_abort_api_answer_goes_to_its_request_not_to_a_namesake() -> None:
    async with _server(time_scale=SLOW) as (sim, http, spawn):
        spawn("bg", LONG)
        first = spawn("same", LONG)
        await _until(lambda: sim.engine.output_tokens("cmpl-same-0") > 0)
        r = await http.post("/inference/v1/abort_requests", json={"request_ids": ["cmpl-same-0"]})
        assert r.json() == {"aborted": ["cmpl-same-0"]}
        retry = await _successor_during_the_abort_step(sim, http, "cmpl-same-0")
        assert retry.status_code == 200, retry.text
        assert retry.json()["usage"]["completion_tokens"] == 3
        aborted = await first
        assert aborted.status_code == 500
        assert aborted.json()["error"]["message"] == "the request was aborted by the engine"


async def test_a_zombie_keeps_its_name_until_it_finishes() -> None:
    zombies = dataclasses.replace(CPU_TINY, abort_on_disconnect=False)
    async with _server(zombies) as (sim, http, _):
        assert sim.port is not None
        gone = await _raw_post(sim.port, "z", {"prompt": "x", "max_tokens": 60, "ignore_eos": True})
        await _until(lambda: sim.engine.output_tokens("cmpl-z-0") > 0)
        gone.transport.abort()
        await _until(lambda: sim.engine.zombie_tokens_total > 0)  # the disconnect is known
        assert sim.open_requests == 1 and "cmpl-z-0" in sim.engine
        body = {"prompt": "y", "max_tokens": 2, "ignore_eos": True}
        r = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "z"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        await _until(lambda: sim.open_requests == 0)
        assert sim.engine.success_total["length"] == 2 and sim.engine.used_blocks == 0


async def test_abort_api_reaches_every_request_given_that_id() -> None:
    """vLLM suffixes its internal ids and aborts all of them for the id a client gave."""
    async with _server() as (sim, http, spawn):
        body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        twins = [spawn("twin", body), spawn("twin", body)]
        await _until(lambda: sim.open_requests == 2 and "cmpl-twin-0" in sim.engine)
        r = await http.post("/inference/v1/abort_requests", json={"request_ids": ["cmpl-twin-0"]})
        aborted = r.json()["aborted"]
        assert len(aborted) == 2 and aborted[0] == "cmpl-twin-0"
        assert all(answer.status_code == 500 for answer in await asyncio.gather(*twins))
        await _until(lambda: sim.open_requests == 0 and sim.engine.used_blocks == 0)
