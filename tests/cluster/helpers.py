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
from typing import IO, Any

import httpx
from gateway.helpers import until_ready

from kvgate.sim.model.engine import Engine, StepResult
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer
from kvgate.testing import FakeEngine, free_port

CLIENT_TIMEOUT_S = 5.0  # a request not answered within this is a hang
SCRAPE_INTERVAL_S = 0.1  # lighter than the default 50 ms on a 2-core machine


@dataclass
class Replica:
    """One `kvgate serve` process."""

    url: str
    process: asyncio.subprocess.Process
    headers: dict[str, str] = field(default_factory=dict)  # sent with /admin/state
    log: Path | None = None  # its stderr, when the test keeps it

    def logged(self) -> str:
        return "" if self.log is None else self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def replicas(
    n: int,
    store_url: str,
    engines: list[FakeEngine] | list[str],
    *,
    config: Path | None = None,
    headers: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    logs: Path | None = None,
    ready: bool = True,
) -> AsyncIterator[list[Replica]]:
    """`n` kvgate serve processes on one store in front of `engines` (fake engines or
    URLs), ready (`ready`; else only answering /healthz); each is stopped with SIGTERM at
    the end (or found already dead: a test may kill one). `config`: a YAML file every
    replica reads; `headers`: what /admin/state needs then; `env`: more environment;
    `logs`: a directory for each replica's stderr (`Replica.log`), at INFO."""
    urls = [e if isinstance(e, str) else e.url for e in engines]
    backends = [part for url in urls for part in ("--backend", url)]
    if config is not None:
        backends = ["--config", str(config), *backends]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    base["KVGATE_SCRAPE__INTERVAL_S"] = str(SCRAPE_INTERVAL_S)
    base.update(env or {})
    level = "warning" if logs is None else "info"
    started: list[Replica] = []
    files: list[IO[bytes]] = []
    if logs is not None:
        await asyncio.to_thread(logs.mkdir, parents=True, exist_ok=True)
    try:
        for i in range(n):
            port = free_port()
            log = None if logs is None else logs / f"replica-{i}.log"
            stderr = None if log is None else log.open("wb")
            if stderr is not None:
                files.append(stderr)
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvgate", "serve", "--port", str(port),
                "--store", store_url, "--log-level", level, *backends,
                stdout=asyncio.subprocess.DEVNULL, stderr=stderr, env=base,
            )  # fmt: skip
            started.append(Replica(f"http://127.0.0.1:{port}", process, headers or {}, log))
        for replica in started:
            async with httpx.AsyncClient(base_url=replica.url) as client:
                if ready:
                    assert await until_ready(client, 30.0), "a replica never became ready"
                else:
                    assert await until_up(client, 30.0), "a replica never answered"
        yield started
    finally:
        for replica in started:
            if replica.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    replica.process.send_signal(signal.SIGCONT)  # a test may have frozen it
                    replica.process.send_signal(signal.SIGTERM)
        for replica in started:
            try:
                await asyncio.wait_for(replica.process.wait(), 15)
            except TimeoutError:
                replica.process.kill()
                await replica.process.wait()
        for file in files:
            file.close()


async def until_up(client: httpx.AsyncClient, within: float) -> bool:
    """Poll `GET /healthz` until the process answers (ready or not)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get("/healthz")).status_code == 200:
                return True
        await asyncio.sleep(0.05)
    return False


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


class SimEngines:
    """Simulated vLLM engines (the tiny CPU preset: 4,096 KV tokens each) in this process,
    `time_scale` times slower than the preset, each step watched: the highest KV usage any
    engine reached and the preemptions they made (evicting a running request)."""

    def __init__(self, n: int, *, time_scale: float = 1.0) -> None:
        self.servers = [
            SimServer(Engine(CPU_TINY, seed=i), model_name="sim-llama", time_scale=time_scale)
            for i in range(n)
        ]
        self.peak = 0.0
        self.watching = True
        for server in self.servers:
            self._watch(server.engine)

    def _watch(self, engine: Engine) -> None:
        finish = engine.finish_step

        def finish_and_watch() -> StepResult:
            result = finish()
            if self.watching:
                self.peak = max(self.peak, engine.kv_usage)
            return result

        engine.finish_step = finish_and_watch  # type: ignore[method-assign]

    @property
    def preemptions(self) -> int:
        return sum(s.engine.preemptions_evicted for s in self.servers)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s.port}" for s in self.servers]

    async def __aenter__(self) -> SimEngines:
        for server in self.servers:
            await server.start("127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for server in self.servers:
            await server.close()


async def completion(
    gw: Replica, prompt: int, output: int, *, within: float = 60.0, max_wait_ms: int = 30_000
) -> int:
    """A streamed completion of `prompt` token ids that runs `output` steps (ignore_eos),
    read to its end; its status."""
    body = {
        "model": "sim-llama",
        "prompt": [7] * prompt,
        "max_tokens": output,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-kvgate-max-wait-ms": str(max_wait_ms)}
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=within) as client,
        client.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        async for _ in response.aiter_bytes():
            pass
        return response.status_code


@contextlib.asynccontextmanager
async def on_sim_engines(
    n: int, store_url: str, engines: int, *, time_scale: float
) -> AsyncIterator[tuple[SimEngines, list[Replica]]]:
    """`n` replicas on one store in front of `engines` simulated engines, in sync and with
    every engine fresh everywhere."""
    async with (
        SimEngines(engines, time_scale=time_scale) as sims,
        replicas(n, store_url, sims.urls) as served,
    ):
        await synced_again(served, "started")
        assert await wait_for(fresh_everywhere(served), 10.0)
        yield sims, served


def count(statuses: list[int]) -> dict[int, int]:
    """How many of each status."""
    return {s: statuses.count(s) for s in sorted(set(statuses))}
