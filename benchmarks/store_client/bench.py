"""Which asyncio Redis client for the cluster store: redis-py (with and without hiredis)
against coredis, on the real redis-server over loopback TCP.

The operations are the ones a sync tick needs:

- `pipeline`: a pipelined write of a 2 KB view blob (HSET) and a read of all views
  (HGETALL of 4 views of 2 KB each), one round trip;
- `evalsha`: EVALSHA of kvgate's own sync script (`kvgate.cluster.lua.SYNC`: prune
  expired members, heartbeat, store the view, return the store's time and every view),
  with the same 4 views in the store;
- `heartbeat`: SET key value PX 2000.

Each client runs on uvloop (as the gateway does), one command at a time. Clients and
operations are interleaved round by round in one process, so the machine's noise falls on
all of them alike. Latency is wall time per operation (p50, p99 over every round); CPU is
this process's CPU time (`time.process_time`) per operation, the median of the rounds.
Writes results.md next to this file.

    .venv/bin/python benchmarks/store_client/bench.py [--rounds 15] [--ops 400]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import uvloop

from kvgate.cluster.lua import MEMBERS_KEY, SYNC, VIEWS_KEY
from kvgate.procs.redis_server import RedisServer

VIEW = os.urandom(1024).hex().encode()  # 2 KB, incompressible like a real JSON view
PEERS = 4
TTL_MS = 2000

Op = Callable[[], Awaitable[Any]]


class RedisPy:
    def __init__(self, url: str, hiredis: bool) -> None:
        import redis.asyncio as aredis
        from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

        parser = _AsyncHiredisParser if hiredis else _AsyncRESP3Parser
        self.client = aredis.Redis.from_url(url, parser_class=parser)
        self.script = self.client.register_script(SYNC)
        self.name = f"redis-py {version('redis')}" + (
            f" + hiredis {version('hiredis')}" if hiredis else " (pure Python parser)"
        )

    async def __aenter__(self) -> RedisPy:
        await self.client.ping()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def pipeline(self) -> Any:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(VIEWS_KEY, "bench-0", VIEW)
            pipe.hgetall(VIEWS_KEY)
            return (await pipe.execute())[1]

    async def evalsha(self) -> Any:
        return await self.script(keys=[MEMBERS_KEY, VIEWS_KEY], args=["bench-0", VIEW, TTL_MS])

    async def heartbeat(self) -> Any:
        return await self.client.set("kvgate:bench:beat", b"1", px=TTL_MS)


class Coredis:
    def __init__(self, url: str) -> None:
        import coredis

        self.client = coredis.Redis.from_url(url)
        self.script = self.client.register_script(SYNC)
        self.name = f"coredis {version('coredis')}"

    async def __aenter__(self) -> Coredis:
        await self.client.__aenter__()
        await self.client.ping()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(None, None, None)

    async def pipeline(self) -> Any:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(VIEWS_KEY, {"bench-0": VIEW})
            views = pipe.hgetall(VIEWS_KEY)
        return await views

    async def evalsha(self) -> Any:
        return await self.script(keys=[MEMBERS_KEY, VIEWS_KEY], args=["bench-0", VIEW, TTL_MS])

    async def heartbeat(self) -> Any:
        return await self.client.set("kvgate:bench:beat", b"1", px=TTL_MS)


OPS = ("pipeline", "evalsha", "heartbeat")


async def seed(url: str) -> None:
    """PEERS live members with a 2 KB view each (the 'others' every tick reads)."""
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(url)
    script = client.register_script(SYNC)
    for i in range(1, PEERS):
        await script(keys=[MEMBERS_KEY, VIEWS_KEY], args=[f"bench-{i}", VIEW, 3_600_000])
    await client.aclose()


async def batch(op: Op, n: int, lat: list[float]) -> float:
    """Run `op` n times; append each latency (s) to `lat`; return CPU seconds per op."""
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        lat.append(time.perf_counter() - t0)
    return (time.process_time() - cpu0) / n


async def check(client: Any) -> None:
    """Every client sees the same store: all PEERS views, and the script's reply shape."""
    views = await client.pipeline()
    assert len(views) == PEERS, views.keys()
    reply = await client.evalsha()
    assert len(reply) == 3 and len(reply[2]) == 2 * PEERS, reply[:2]


async def run(url: str, rounds: int, ops: int) -> tuple[list[str], dict[tuple[str, str], Any]]:
    await seed(url)
    clients = [RedisPy(url, hiredis=True), RedisPy(url, hiredis=False), Coredis(url)]
    names = [c.name for c in clients]
    lat: dict[tuple[str, str], list[float]] = {(c.name, o): [] for c in clients for o in OPS}
    cpu: dict[tuple[str, str], list[float]] = {(c.name, o): [] for c in clients for o in OPS}
    for c in clients:
        await c.__aenter__()
    try:
        for c in clients:
            await check(c)
            for o in OPS:  # warm-up: connections, script cache, code paths
                await batch(getattr(c, o), 200, [])
        for r in range(rounds):
            order = clients[r % len(clients) :] + clients[: r % len(clients)]
            for c in order:
                for o in OPS:
                    cpu[c.name, o].append(await batch(getattr(c, o), ops, lat[c.name, o]))
    finally:
        for c in clients:
            await c.__aexit__()
    figures: dict[tuple[str, str], Any] = {}
    for key, values in lat.items():
        values.sort()
        figures[key] = {
            "p50_us": values[len(values) // 2] * 1e6,
            "p99_us": values[int(len(values) * 0.99)] * 1e6,
            "cpu_us": statistics.median(cpu[key]) * 1e6,
            "n": len(values),
        }
    return names, figures


def write(path: Path, names: list[str], figures: dict[tuple[str, str], Any], args: Any) -> str:
    redis_version = os.popen("redis-server --version").read().split()[2]
    lines = [
        "| client | operation | latency p50 | latency p99 | client CPU per op |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for o in OPS:
        for name in names:
            f = figures[name, o]
            lines.append(
                f"| {name} | {o} | {f['p50_us']:.0f} µs | {f['p99_us']:.0f} µs "
                f"| {f['cpu_us']:.0f} µs |"
            )
    table = "\n".join(lines)
    header = (
        f"python {platform.python_version()}, uvloop {version('uvloop')}, {redis_version},"
        f" loopback TCP, {args.rounds} rounds x {args.ops} ops per client and operation,"
        f" load average {os.getloadavg()[0]:.1f} at the end"
    )
    return header + "\n\n" + table + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=400)
    parser.add_argument("--out", type=Path, default=None, help="print only, unless given")
    args = parser.parse_args()
    with RedisServer.start(port=0) as server:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            names, figures = runner.run(run(server.url, args.rounds, args.ops))
    text = write(Path(), names, figures, args)
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
