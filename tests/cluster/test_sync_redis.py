"""Sync tasks running for real against redis-server: join, leave, and every store fault
(slow, unreachable, killed and restarted empty) turning into isolation and back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvgate.cluster.redis_store import RedisStore
from kvgate.cluster.sync import ClusterSync
from kvgate.core.clock import MonotonicClock
from kvgate.procs.redis_server import RedisServer
from kvgate.testing import eventually, free_port

from .conftest import DelayProxy, RecordingParticipant, RecordingSink

NODES = ["e1", "e2", "e3", "e4"]

pytestmark = pytest.mark.redis_server


@contextlib.asynccontextmanager
async def running(url: str, n: int) -> AsyncIterator[list[ClusterSync]]:
    syncs = [
        ClusterSync(
            RedisStore(url),
            RecordingParticipant(view={"replica": i}),
            RecordingSink(),
            MonotonicClock(),
            nodes=lambda: NODES,
            expected_members=n,
        )
        for i in range(n)
    ]
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(s.run()) for s in syncs]
        try:
            yield syncs
        finally:
            for task in tasks:
                task.cancel()


def members(syncs: list[ClusterSync]) -> list[int | None]:
    return [s.participant.members if s.state == "synced" else None for s in syncs]  # type: ignore[attr-defined]


async def test_replicas_join_and_a_stopped_one_leaves_at_once(redis: RedisServer) -> None:
    async with running(redis.url, 3) as syncs:
        assert await eventually(lambda: members(syncs) == [3, 3, 3], 3.0), members(syncs)
        extra = ClusterSync(
            RedisStore(redis.url),
            RecordingParticipant(),
            RecordingSink(),
            MonotonicClock(),
            nodes=lambda: NODES,
        )
        task = asyncio.create_task(extra.run())
        assert await eventually(lambda: members(syncs) == [4, 4, 4], 3.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # it left the store on its way out: gone at the next tick, not after its ttl
        assert await eventually(lambda: members(syncs) == [3, 3, 3], 0.5)


async def test_slow_and_unreachable_store_isolate_and_recovery_needs_no_restart(
    delay_proxy: DelayProxy,
) -> None:
    async with running(delay_proxy.url, 2) as syncs:
        assert await eventually(lambda: members(syncs) == [2, 2], 3.0)
        delay_proxy.delay_s = 0.2  # 200 ms per command
        assert await eventually(lambda: all(s.state == "isolated" for s in syncs), 3.0)
        assert [s.participant.isolated for s in syncs] == [2, 2]  # type: ignore[attr-defined]
        delay_proxy.delay_s = 0.0
        assert await eventually(lambda: members(syncs) == [2, 2], 3.0)
        delay_proxy.blackhole = True  # new connections hang, open ones are cut
        delay_proxy.cut()
        assert await eventually(lambda: all(s.state == "isolated" for s in syncs), 3.0)
        delay_proxy.blackhole = False
        assert await eventually(lambda: members(syncs) == [2, 2], 3.0)


async def test_store_killed_then_restarted_empty() -> None:
    port = free_port()
    server = RedisServer.start(port=port)
    try:
        async with running(server.url, 3) as syncs:
            assert await eventually(lambda: members(syncs) == [3, 3, 3], 3.0)
            server.kill()
            assert await eventually(lambda: all(s.state == "isolated" for s in syncs), 3.0)
            assert all(s.scrapes(n) for s in syncs for n in NODES)
            server = RedisServer.start(port=port)
            assert await eventually(lambda: members(syncs) == [3, 3, 3], 3.0)
    finally:
        server.stop()
