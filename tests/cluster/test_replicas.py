"""Replicas as real `kvgate serve` processes sharing a real redis-server.

Each engine is polled by one replica and its samples reach the others; a replica killed
with SIGKILL is forgotten within the documented bound; the store slow, unreachable, killed
and restarted empty never makes a replica hang or answer 500, and the replicas find each
other again without a restart; `--workers` restarts its private redis-server when it dies,
and the workers rejoin it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway.helpers import until_ready

from kvgate.cluster.sync import REMOVAL_BOUND_S
from kvgate.procs.redis_server import RedisServer
from kvgate.testing import FakeEngine, free_port

from .conftest import DelayProxy
from .helpers import (
    CLIENT_TIMEOUT_S,
    Replica,
    fresh_everywhere,
    replicas,
    state,
    synced_again,
    wait_for,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_server]


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
        status = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate", "status", "--url", served[0].url,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        )  # fmt: skip
        shown = (await asyncio.wait_for(status.communicate(), 30))[0].decode()
    index = {s["cluster"]["member_id"]: i for i, s in enumerate(states)}
    for node, owner in states[0]["cluster"]["shards"].items():
        polls = [after[i][node] - before[i][node] for i in range(3)]
        by_owner = polls[index[owner]]
        # The owner polls; the others only while the store did not answer them in time (a
        # stalled machine can make a tick late), then every replica polls everything.
        assert by_owner >= 4 * (sum(polls) - by_owner), (node, polls, index[owner])
    # One replica's polls per engine (every 100 ms: 10/s), not three replicas' (30/s).
    assert all(2 <= r <= 15 for r in rates), rates
    # `kvgate status` shows the replicas, and which engines this one takes from the store
    assert "replicas (3)" in shown and "(this one)" in shown and "SYNCED" in shown, shown
    assert "shared" in shown, shown


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
        async with httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
            for _ in range(20_000):  # bounded; stopped long before
                if self._stop.is_set():
                    return
                try:
                    response = await client.post("/v1/completions", json=body)
                except httpx.TimeoutException:
                    self.bad.append(f"{gw.url}: no answer within {CLIENT_TIMEOUT_S} s")
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
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
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
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, stderr.decode()[-2000:]
    socket_dir = store.removeprefix("unix://").split("?")[0].rsplit("/", 1)[0]
    assert not await asyncio.to_thread(Path(socket_dir).exists)  # stopped, and removed


async def test_workers_restart_their_private_redis_server_when_it_dies(
    fake_engine: FakeEngine, tmp_path: Path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    log = tmp_path / "supervisor.log"
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate", "serve", "--workers", "2", "--port", str(port),
            "--backend", fake_engine.url, "--log-level", "warning", env=env, stderr=stderr,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    async def both_synced() -> bool:
        states = await states_by_connection(url, 12)
        synced = {s["cluster"]["state"] for s in states}
        return all_members_seen(states) == 2 and synced == {"synced"}

    try:
        assert await wait_for(both_synced, 30.0)
        [first] = redis_children(process.pid)
        os.kill(first, signal.SIGKILL)

        async def restarted() -> bool:
            return bool(set(redis_children(process.pid)) - {first})

        assert await wait_for(restarted, 10.0), log.read_text()
        assert await wait_for(both_synced, 20.0), await states_by_connection(url, 4)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)
    said = log.read_text()
    assert process.returncode == 0, said[-2000:]
    assert f"redis-server (pid {first}) exited" in said and "restarted" in said, said[-2000:]


def redis_children(pid: int) -> list[int]:
    """The live redis-server processes `pid` started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, _, rest = stat.partition(") ")
        state, ppid = rest.split()[:2]
        if int(ppid) == pid and name.endswith("(redis-server") and state != "Z":
            found.append(int(entry.name))
    return found


async def states_by_connection(url: str, n: int) -> list[dict[str, Any]]:
    """/admin/state over `n` new connections (the kernel picks a worker for each)."""
    out = []
    for _ in range(n):
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
            out.append((await client.get("/admin/state")).json())
    return out


def all_members_seen(states: list[dict[str, Any]]) -> int:
    counts = {s["cluster"]["replicas"] for s in states if s["cluster"]}
    return counts.pop() if len(counts) == 1 else -1
