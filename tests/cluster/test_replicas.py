"""Replicas as real `kvgate serve` processes sharing a real redis-server.

Each engine is polled by one replica and its samples reach the others; a replica killed
with SIGKILL is forgotten within the documented bound; the store slow, unreachable, killed
and restarted empty never makes a replica hang or answer 500, and the replicas find each
other again without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import FakeEngine, eventually
from gateway.helpers import until_ready

from kvgate.cluster.redis_server import RedisServer, free_port
from kvgate.cluster.sync import REMOVAL_BOUND_S

from .conftest import DelayProxy

pytestmark = pytest.mark.timeout(180)

_CLIENT_TIMEOUT_S = 5.0  # a request not answered within this is a hang
SCRAPE_INTERVAL_S = 0.1  # lighter than the default 50 ms on a 2-core machine


@dataclass
class Replica:
    """One `kvgate serve` process."""

    url: str
    process: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def replicas(
    n: int, store_url: str, engines: list[FakeEngine]
) -> AsyncIterator[list[Replica]]:
    """`n` kvgate serve processes on one store in front of `engines`, all ready; each is
    stopped with SIGTERM at the end (or found already dead: a test may kill one)."""
    backends = [part for e in engines for part in ("--backend", e.url)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_SCRAPE__INTERVAL_S"] = str(SCRAPE_INTERVAL_S)
    started: list[Replica] = []
    try:
        for _ in range(n):
            port = free_port()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvgate", "serve", "--port", str(port),
                "--store", store_url, "--log-level", "warning", *backends,
                stdout=asyncio.subprocess.DEVNULL, env=env,
            )  # fmt: skip
            started.append(Replica(f"http://127.0.0.1:{port}", process))
        for replica in started:
            async with httpx.AsyncClient(base_url=replica.url) as client:
                assert await until_ready(client, 30.0), "a replica never became ready"
        yield started
    finally:
        for replica in started:
            if replica.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.send_signal(signal.SIGTERM)
        for replica in started:
            try:
                await asyncio.wait_for(replica.process.wait(), 15)
            except TimeoutError:
                replica.process.kill()
                await replica.process.wait()


async def state(gw: Replica) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=gw.url, timeout=_CLIENT_TIMEOUT_S) as client:
        data: dict[str, Any] = (await client.get("/admin/state")).json()
        return data


async def wait_for(predicate: Any, within: float, every: float = 0.1) -> bool:
    """Poll an async predicate until it holds (bounded)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if await predicate():
                return True
        await asyncio.sleep(every)
    return False


def all_synced(served: list[Replica], count: int) -> Any:
    async def check() -> bool:
        states = [await state(gw) for gw in served]
        return all(
            s["cluster"]["state"] == "synced" and s["cluster"]["replicas"] == count for s in states
        )

    return check


async def scrape_counts(served: list[Replica]) -> list[dict[str, int]]:
    """Per replica: node id -> scrapes it made itself."""
    out = []
    for gw in served:
        nodes = (await state(gw))["scraper"]["nodes"]
        out.append({node: info["scrapes_total"] for node, info in nodes.items()})
    return out


async def test_each_engine_is_polled_by_one_replica_and_its_samples_reach_all(
    redis: RedisServer, engine_factory: Any
) -> None:
    engines: list[FakeEngine] = [await engine_factory() for _ in range(4)]
    async with replicas(3, redis.url, engines) as served:
        await synced_again(served, "started")
        assert await wait_for(fresh_everywhere(served), 10.0)
        before = await scrape_counts(served)
        hits_before, started = [e.metrics_hits for e in engines], time.monotonic()
        await asyncio.sleep(3.0)
        elapsed = time.monotonic() - started
        rates = [(e.metrics_hits - h) / elapsed for e, h in zip(engines, hits_before, strict=True)]
        after = await scrape_counts(served)
        states = [await state(gw) for gw in served]
        assert await wait_for(fresh_everywhere(served), 5.0)  # polled or not, every engine
    index = {s["cluster"]["member_id"]: i for i, s in enumerate(states)}
    for node, owner in states[0]["cluster"]["shards"].items():
        polls = [after[i][node] - before[i][node] for i in range(3)]
        by_owner = polls[index[owner]]
        # The owner polls; the others only while the store did not answer them in time (a
        # stalled machine can make a tick late), then every replica polls everything.
        assert by_owner >= 4 * (sum(polls) - by_owner), (node, polls, index[owner])
    # One replica's polls per engine (every 100 ms: 10/s), not three replicas' (30/s).
    assert all(2 <= r <= 15 for r in rates), rates


def fresh_everywhere(served: list[Replica]) -> Any:
    async def check() -> bool:
        states = [await state(gw) for gw in served]
        return all(n["fresh"] for s in states for n in s["policy"]["nodes"].values())

    return check


async def test_a_replica_killed_with_sigkill_is_forgotten_within_the_bound(
    redis: RedisServer, engine_factory: Any
) -> None:
    engines = [await engine_factory() for _ in range(3)]
    async with replicas(3, redis.url, engines) as served:
        await synced_again(served, "started")
        victim = (await state(served[2]))["cluster"]["member_id"]
        killed_at = time.monotonic()
        served[2].process.send_signal(signal.SIGKILL)
        survivors = served[:2]
        await synced_again(survivors, "joined by a replica that was then killed", every=0.05)
        forgotten_after = time.monotonic() - killed_at
        for s in [await state(gw) for gw in survivors]:
            assert victim not in s["cluster"]["shards"].values()
        assert await wait_for(fresh_everywhere(survivors), 5.0)  # its engines, polled anew
        client = RedisStoreProbe(redis.url)
        assert victim not in await client.members()
        await client.close()
    print(f"SIGKILLed replica forgotten after {forgotten_after:.2f} s")
    assert forgotten_after <= 5.0  # REMOVAL_BOUND_S (2.2 s) plus this machine's noise
    assert REMOVAL_BOUND_S <= 5.0


class RedisStoreProbe:
    """Reads the store's members without joining them."""

    def __init__(self, url: str) -> None:
        import redis.asyncio as aredis

        from kvgate.cluster import lua

        self._client = aredis.Redis.from_url(url)
        self._views = lua.VIEWS_KEY

    async def members(self) -> set[str]:
        return {k.decode() for k in await self._client.hkeys(self._views)}

    async def close(self) -> None:
        await self._client.aclose()


async def synced_again(served: list[Replica], phase: str, every: float = 0.1) -> None:
    """Every replica in sync, seeing all of `served`, within 20 s; else say where each is."""
    if await wait_for(all_synced(served, len(served)), 20.0, every):
        return
    states = [(await state(gw))["cluster"] for gw in served]
    detail = [(s["state"], s["replicas"], s["sync"]) for s in states]
    raise AssertionError(f"no recovery after the store was {phase}: {detail}")


class Load:
    """Clients sending small completions to every replica until stopped; every answer
    is kept (status, whether a refusal carried Retry-After) and so is every hang."""

    def __init__(self, served: list[Replica]) -> None:
        self.served = served
        self.statuses: dict[int, int] = {}
        self.bad: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(gw)) for gw in self.served]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, gw: Replica) -> None:
        body = {"model": "fake-model", "prompt": "hello", "max_tokens": 8}
        async with httpx.AsyncClient(base_url=gw.url, timeout=_CLIENT_TIMEOUT_S) as client:
            for _ in range(20_000):  # bounded; stopped long before
                if self._stop.is_set():
                    return
                try:
                    response = await client.post("/v1/completions", json=body)
                except httpx.TimeoutException:
                    self.bad.append(f"{gw.url}: no answer within {_CLIENT_TIMEOUT_S} s")
                    continue
                status = response.status_code
                self.statuses[status] = self.statuses.get(status, 0) + 1
                if status not in (200, 429, 503):
                    self.bad.append(f"{gw.url}: {status} {response.text[:200]}")
                elif status != 200 and "retry-after" not in response.headers:
                    self.bad.append(f"{gw.url}: {status} without Retry-After")
                await asyncio.sleep(0.01)


async def test_store_faults_never_stop_a_replica_answering_and_it_recovers(
    engine_factory: Any,
) -> None:
    port = free_port()
    server = RedisServer.start(port=port)
    proxy = await DelayProxy(port).start()
    engines = [await engine_factory() for _ in range(2)]
    try:
        async with replicas(2, proxy.url, engines) as served:
            await synced_again(served, "started")
            load = Load(served).start()

            async def isolated() -> bool:
                states = [await state(gw) for gw in served]
                return all(s["cluster"]["state"] == "isolated" for s in states)

            phases: list[tuple[str, float]] = []
            started = time.monotonic()
            # slow: 200 ms per command
            proxy.delay_s = 0.2
            assert await wait_for(isolated, 10.0), "a slow store did not isolate"
            proxy.delay_s = 0.0
            await synced_again(served, "slow")
            phases.append(("slow", time.monotonic() - started))
            # unreachable: connections hang
            proxy.blackhole = True
            proxy.cut()
            assert await wait_for(isolated, 10.0), "an unreachable store did not isolate"
            proxy.blackhole = False
            await synced_again(served, "unreachable")
            phases.append(("unreachable", time.monotonic() - started))
            # killed, then restarted empty on the same port
            server.kill()
            assert await wait_for(isolated, 10.0), "a dead store did not isolate"
            server = RedisServer.start(port=port)
            await synced_again(served, "restarted empty")
            phases.append(("restarted empty", time.monotonic() - started))
            await load.stop()
    finally:
        await proxy.stop()
        server.stop()
    print(f"phases {phases}, answers {load.statuses}")
    assert not load.bad, load.bad[:10]
    assert load.statuses.get(200, 0) > 50, load.statuses


async def test_workers_share_one_port_and_a_private_store(fake_engine: FakeEngine) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "serve", "--workers", "2", "--port", str(port),
        "--backend", fake_engine.url, "--log-level", "warning",
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=_CLIENT_TIMEOUT_S) as client:
            assert await until_ready(client, 30.0)

        async def two_members() -> bool:
            return all_members_seen(await states_by_connection(url, 12)) == 2

        assert await wait_for(two_members, 15.0)
        seen = await states_by_connection(url, 20)
        pids = {s["cluster"]["members"][0]["pid"] for s in seen if s["cluster"]}
        ids = {s["cluster"]["member_id"] for s in seen}
        assert len(ids) == 2, ids  # both workers accept on the one port
        store = seen[0]["cluster"]["store"]
        assert store.startswith("unix://")  # the private redis-server
        # a worker killed while serving is replaced
        worker_pid = next(iter(pids))
        os.kill(worker_pid, signal.SIGKILL)

        async def replaced() -> bool:
            states = await states_by_connection(url, 12)
            return all_members_seen(states) == 2 and worker_pid not in {
                m["pid"] for s in states for m in s["cluster"]["members"]
            }

        assert await wait_for(replaced, 20.0)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()[-2000:]
    socket_dir = store.removeprefix("unix://").split("?")[0].rsplit("/", 1)[0]
    assert not await asyncio.to_thread(Path(socket_dir).exists)  # stopped, and removed


async def states_by_connection(url: str, n: int) -> list[dict[str, Any]]:
    """/admin/state over `n` new connections (the kernel picks a worker for each)."""
    out = []
    for _ in range(n):
        async with httpx.AsyncClient(base_url=url, timeout=_CLIENT_TIMEOUT_S) as client:
            out.append((await client.get("/admin/state")).json())
    return out


def all_members_seen(states: list[dict[str, Any]]) -> int:
    counts = {s["cluster"]["replicas"] for s in states if s["cluster"]}
    return counts.pop() if len(counts) == 1 else -1


async def test_workers_without_a_store_or_redis_server_say_what_they_need() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PATH"] = "/nonexistent"  # no redis-server to be found
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "serve", "--workers", "2",
        "--backend", "http://127.0.0.1:9", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert b"--store" in stderr and b"apt-get install redis-server" in stderr


async def test_without_a_store_a_gateway_runs_alone(
    gateway_factory: Any, fake_engine: FakeEngine
) -> None:
    gw = await gateway_factory([fake_engine.url])
    assert gw.gateway.cluster is None
    assert gw.gateway.state()["cluster"] is None
    assert await eventually(lambda: fake_engine.metrics_hits > 0, 5.0)
