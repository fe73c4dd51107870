"""Fixtures of the cluster tests: the real redis-server, a delaying TCP proxy in front of
it, and a participant and a sink that record what the sync task gives them.

Every server is started by the test on a free port of 127.0.0.1 and stopped after it;
tests that need no store use `kvgate.cluster.store.MemoryStore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from kvgate.core.replicas.view import PeerView
from kvgate.core.signals import NodeSample
from kvgate.procs.redis_server import RedisServer, find_redis_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Without redis-server the tests that need it skip locally; CI installs it, and fails."""
    if find_redis_server() is not None or os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason="redis-server is not installed (apt-get install redis-server)")
    for item in items:
        if item.get_closest_marker("redis_server") is not None:
            item.add_marker(skip)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh redis-server on a free port of 127.0.0.1."""
    with RedisServer.start(port=0) as server:
        yield server


@dataclass
class RecordingParticipant:
    """Stands in for the core's admission object: its view is `view`; it keeps what the
    sync task hands it."""

    view: PeerView = field(default_factory=lambda: PeerView("local"))
    peer_views: list[PeerView] | None = None
    members: int | None = None
    isolated: int | None = None
    calls: list[str] = field(default_factory=list)

    def local_view(self) -> PeerView:
        return self.view

    def set_peer_views(self, views: Sequence[PeerView], members: int) -> None:
        self.peer_views = list(views)
        self.members = members
        self.isolated = None
        self.calls.append("peers")

    def set_isolated(self, members: int) -> None:
        self.isolated = members
        self.calls.append("isolated")


@dataclass
class RecordingSink:
    """Stands in for the policy's `observe`/`observe_failure`."""

    samples: list[tuple[str, NodeSample]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def observe(self, node_id: str, sample: NodeSample) -> None:
        self.samples.append((node_id, sample))

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        self.failures.append(node_id if hard else f"{node_id} (soft)")

    def last(self, node_id: str) -> NodeSample | None:
        found = [s for n, s in self.samples if n == node_id]
        return found[-1] if found else None


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that delays every chunk from the client by `delay_s`
    before it reaches the server (a slow store), or accepts and forwards nothing while
    `blackhole` is set (an unreachable one)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.blackhole = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        """Close every open connection (the clients see a reset)."""
        for task in list(self._tasks):
            task.cancel()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self.blackhole:
                await asyncio.sleep(3600)
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pipe(reader, up_w, delayed=True))
                    group.create_task(self._pipe(up_r, writer, delayed=False))
            finally:
                up_w.close()
        except (OSError, ExceptionGroup):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        while data := await reader.read(65536):
            if delayed and self.delay_s:
                await asyncio.sleep(self.delay_s)
            writer.write(data)
            await writer.drain()
        writer.close()


@pytest.fixture
async def delay_proxy(redis: RedisServer) -> AsyncIterator[DelayProxy]:
    assert redis.port is not None
    proxy = await DelayProxy(redis.port).start()
    try:
        yield proxy
    finally:
        with contextlib.suppress(Exception):
            await proxy.stop()
