"""Gateway replicas as real processes for the cluster tests (and the dashboard's): start
N `kvgate serve` on one store, read their state, wait for them to agree."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from gateway.helpers import until_ready

from kvgate.testing import FakeEngine, free_port

CLIENT_TIMEOUT_S = 5.0  # a request not answered within this is a hang
SCRAPE_INTERVAL_S = 0.1  # lighter than the default 50 ms on a 2-core machine


@dataclass
class Replica:
    """One `kvgate serve` process."""

    url: str
    process: asyncio.subprocess.Process
    headers: dict[str, str] = field(default_factory=dict)  # sent with /admin/state


@contextlib.asynccontextmanager
async def replicas(
    n: int,
    store_url: str,
    engines: list[FakeEngine],
    *,
    config: Path | None = None,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[list[Replica]]:
    """`n` kvgate serve processes on one store in front of `engines`, all ready; each is
    stopped with SIGTERM at the end (or found already dead: a test may kill one).
    `config`: a YAML file every replica reads; `headers`: what /admin/state needs then."""
    backends = [part for e in engines for part in ("--backend", e.url)]
    if config is not None:
        backends = ["--config", str(config), *backends]
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
            started.append(Replica(f"http://127.0.0.1:{port}", process, headers or {}))
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
    async with httpx.AsyncClient(base_url=gw.url, timeout=CLIENT_TIMEOUT_S) as client:
        data: dict[str, Any] = (await client.get("/admin/state", headers=gw.headers)).json()
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


async def synced_again(served: list[Replica], phase: str, every: float = 0.1) -> None:
    """Every replica in sync, seeing all of `served`, within 20 s; else say where each is."""
    if await wait_for(all_synced(served, len(served)), 20.0, every):
        return
    states = [(await state(gw))["cluster"] for gw in served]
    detail = [(s["state"], s["replicas"], s["sync"]) for s in states]
    raise AssertionError(f"no recovery after the store was {phase}: {detail}")


def fresh_everywhere(served: list[Replica]) -> Any:
    async def check() -> bool:
        states = [await state(gw) for gw in served]
        return all(n["fresh"] for s in states for n in s["policy"]["nodes"].values())

    return check
