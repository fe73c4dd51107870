"""Replicas under faults, as real processes: `kvgate serve` replicas sharing a real
redis-server in front of simulated engines (the tiny CPU preset, 4,096 KV tokens each,
every step watched for the highest KV usage and for preemptions).

- a replica frozen (SIGSTOP), or cut off from Redis while it still reaches the engines,
  while its requests run: the others keep planning them after its heartbeat expires,
  until they end, so the room those streams grow into is never given away (peak KV under
  the ceiling, no preemption);
- the store down: a replica alone on an engine starts a request larger than its static
  share of it, and the small requests behind it are served too.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

import pytest

from kvgate.procs.redis_server import RedisServer

from .conftest import DelayProxy
from .helpers import (
    Replica,
    SimEngines,
    completion,
    count,
    fresh_everywhere,
    on_sim_engines,
    replicas,
    state,
    synced_again,
    wait_for,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.redis_server]

CEILING = 0.92  # the panic watermark: what standard requests may plan a node up to


def departed(gw: Replica) -> Any:
    """The replica plans requests of a replica it no longer hears from."""

    async def check() -> bool:
        return bool((await state(gw))["policy"]["cluster"]["departed_requests"])

    return check


def in_flight(gw: Replica, n: int) -> Any:
    async def check() -> bool:
        return int((await state(gw))["policy"]["in_flight_requests"]) >= n

    return check


class Clients:
    """`per_replica` clients per replica, each sending one completion after another until
    stopped; every status kept."""

    def __init__(self, served: list[Replica], per_replica: int, prompt: int, output: int):
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._client(gw, prompt, output))
            for gw in served
            for _ in range(per_replica)
        ]

    async def _client(self, gw: Replica, prompt: int, output: int) -> None:
        while not self._stop.is_set():
            self.statuses.append(await completion(gw, prompt, output, within=120.0))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 120)


@pytest.mark.parametrize("fault", ["frozen", "partitioned"])
async def test_a_departed_replicas_requests_stay_planned_until_they_end(
    redis: RedisServer, delay_proxy: DelayProxy, fault: str
) -> None:
    """`frozen`: SIGSTOP for 10 s. `partitioned`: cut off from Redis for 10 s (its store
    connections reset, new ones accepted and never answered) while it still reaches the
    engines and its streams go on."""
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(SimEngines(2, time_scale=3.0))
        others = await stack.enter_async_context(replicas(2, redis.url, engines.urls))
        store = redis.url if fault == "frozen" else delay_proxy.url
        (departing,) = await stack.enter_async_context(replicas(1, store, engines.urls))
        served = [*others, departing]
        await synced_again(served, "started")
        assert await wait_for(fresh_everywhere(served), 10.0)
        # Its long requests, two per engine: 100 prompt tokens each that grow to 1,616 over
        # 1,500 steps (~15 s at this time scale), 86 % of an engine for the two at the end.
        held = []
        for n in range(1, 5):
            held.append(asyncio.create_task(completion(departing, 100, 1500, within=180.0)))
            assert await wait_for(in_flight(departing, n), 10.0, every=0.02)
        await asyncio.sleep(1.0)  # running, in the samples, and in the others' plans
        if fault == "frozen":
            departing.process.send_signal(signal.SIGSTOP)
        else:
            delay_proxy.blackhole = True
            delay_proxy.cut()
        departed_at = time.monotonic()
        # The others' clients contend for the rest of the room meanwhile: 400 tokens each,
        # 13 KV blocks of 32, which their footprint (with half a block of rounding) covers.
        load = Clients(others, 8, 100, 300)
        assert await wait_for(departed(others[0]), 10.0), "its heartbeat never expired"
        seen_departed_after = time.monotonic() - departed_at
        await asyncio.sleep(max(0.0, 10.0 - (time.monotonic() - departed_at)))
        if fault == "frozen":
            departing.process.send_signal(signal.SIGCONT)
        else:
            delay_proxy.blackhole = False
        await load.stop()
        statuses = await asyncio.wait_for(asyncio.gather(*held), 180)
        engines.watching = False
    print(
        f"{fault} 10 s (departed after {seen_departed_after:.1f} s): peak KV {engines.peak:.3f},"
        f" {engines.preemptions} preemptions, other requests {count(load.statuses)}"
    )
    assert statuses == [200] * 4
    assert set(load.statuses) <= {200, 429}, count(load.statuses)  # 429: predicted too long
    assert load.statuses.count(200) >= 4, count(load.statuses)  # they are served too
    assert engines.preemptions == 0
    assert engines.peak <= CEILING


async def test_with_the_store_down_a_request_larger_than_the_share_starts(
    redis: RedisServer,
) -> None:
    async with on_sim_engines(3, redis.url, 1, time_scale=2.0) as (engines, served):
        redis.kill()

        async def isolated() -> bool:
            states = [await state(gw) for gw in served]
            return all(s["cluster"]["state"] == "isolated" for s in states)

        assert await wait_for(isolated, 10.0)
        gw = served[0]
        # 1,000 prompt tokens and 800 steps: 1,816 tokens at its end, more than a third of
        # the engine's room under its ceiling (1,256), well inside the room itself.
        started = time.monotonic()
        large = [await completion(gw, 1000, 800, within=60.0) for _ in range(3)]
        took = time.monotonic() - started
        # Small requests behind a large one wait for it, then start (a bound of 60 s: on a
        # loaded host a large one ran 8 s; the test is whether they start, not how soon).
        small = await asyncio.gather(
            completion(gw, 1000, 800, within=120.0, max_wait_ms=60_000),
            *(completion(gw, 100, 50, within=120.0, max_wait_ms=60_000) for _ in range(6)),
        )
        engines.watching = False
    print(f"3 large requests in {took:.1f} s with the store down; peak KV {engines.peak:.3f}")
    assert large == [200, 200, 200]
    assert small == [200] * 7
    assert engines.preemptions == 0
    assert engines.peak <= CEILING
