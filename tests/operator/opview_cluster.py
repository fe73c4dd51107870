"""A real kvgate gateway in front of simulated vLLM engines, all as child processes.

Two simulator processes are started so that one engine can be killed on its own: the
gateway's scrapes of it then fail and the dashboard must flag it stale. `Overload` drives
more KV-cache demand than the engines hold, with a share of clients that hang up mid-stream
and a share that will not wait in the gateway's queue, so that queueing, shedding,
Retry-After and cancellation propagation all show.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvgate.testing import free_port

_URL = re.compile(r"http://127\.0\.0\.1:\d+")
START_TIMEOUT_S = 45.0


@dataclass
class Cluster:
    url: str
    engines: dict[str, str]  # node id -> engine base URL
    processes: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def kill_engine_process(self, name: str) -> None:
        """Stop one simulator process (SIGTERM, then SIGKILL): its engines go silent."""
        _stop(self.processes[name])


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _start_sim(nodes: int, port: int) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kvgate", "sim", "--port", str(port), "--nodes", str(nodes),
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env()
    )


def _wait_announced(process: subprocess.Popen[str], nodes: int) -> None:
    """The simulator prints one line per engine once it accepts connections."""
    assert process.stdout is not None
    seen = 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while seen < nodes and time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen += bool(_URL.search(line))
    if seen < nodes:
        raise RuntimeError(f"kvgate sim did not announce {nodes} engines")
    # Keep draining stdout so the child never blocks on a full pipe.
    threading.Thread(target=process.stdout.read, daemon=True).start()


def free_port_block(count: int, attempts: int = 50) -> int:
    """A port P such that P..P+count-1 are free on 127.0.0.1 now (`kvgate sim --port P`)."""
    for _ in range(attempts):
        first = free_port()
        if first + count > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no block of free ports found")


def _wait_ready(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvgate serve exited with {process.returncode}")
        with suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError("kvgate serve did not become ready")


@contextmanager
def gateway_with_sims(tmp: Path, steady_nodes: int = 3) -> Iterator[Cluster]:
    """`steady_nodes` engines in one simulator process plus `sim-victim` in another."""
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        # Ports chosen up front so that the engines and the gateway all start at once.
        steady_port = free_port_block(steady_nodes)
        processes["steady"] = _start_sim(steady_nodes, steady_port)
        victim_port = free_port_block(1)
        processes["victim"] = _start_sim(1, victim_port)
        engines = {f"sim-{i}": f"http://127.0.0.1:{steady_port + i}" for i in range(steady_nodes)}
        engines["sim-victim"] = f"http://127.0.0.1:{victim_port}"
        config = tmp / "kvgate.yaml"
        lines = ["backends:"]
        for name, url in engines.items():
            lines += [f"  - url: {url}", f"    name: {name}"]
        # The test machine also runs the browser and the load: give a busy simulator
        # more than the default 40 ms to answer a scrape (the timeout is capped at 95% of
        # the interval), so that only a dead engine goes stale.
        lines += ["scrape:", "  interval_s: 0.25"]
        config.write_text("\n".join(lines) + "\n", encoding="utf-8")
        port = free_port()
        command = [
            sys.executable, "-m", "kvgate", "serve", "--config", str(config),
            "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
        processes["gateway"] = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=_env()
        )
        url = f"http://127.0.0.1:{port}"
        _wait_announced(processes["steady"], steady_nodes)
        _wait_announced(processes["victim"], 1)
        _wait_ready(url, processes["gateway"])
        yield Cluster(url=url, engines=engines, processes=processes)
    finally:
        for process in reversed(list(processes.values())):
            _stop(process)


class Overload:
    """`clients` looping clients in a background thread, until `stop()` or `max_seconds`."""

    def __init__(self, url: str, max_seconds: float = 30.0, clients: int = 24) -> None:
        self.counts: dict[str, int] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._run(url, max_seconds, clients)), daemon=True
        )

    def __enter__(self) -> Overload:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join(30)

    async def _run(self, url: str, max_seconds: float, clients: int) -> None:
        deadline = time.monotonic() + max_seconds
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            await asyncio.gather(
                *(_client(client, i, deadline, self._stopped, self.counts) for i in range(clients))
            )


async def _client(
    client: httpx.AsyncClient,
    index: int,
    deadline: float,
    stopped: threading.Event,
    counts: dict[str, int],
) -> None:
    priority = ("critical", "standard", "standard", "sheddable", "sheddable")[index % 5]
    hang_up = index % 4 == 0  # a quarter of the clients leave after the first token
    body = {"model": "sim-llama", "prompt": "tell me a story " * 40, "max_tokens": 600}
    headers = {"X-Kvgate-Priority": priority}
    if priority == "sheddable":  # these will not wait in the gateway's queue: shed at once
        headers["X-Kvgate-Max-Wait-Ms"] = "0"
    sent = 0

    def over() -> bool:
        return stopped.is_set() or time.monotonic() > deadline

    while not over() and sent < 400:
        sent += 1
        try:
            async with client.stream(
                "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
            ) as response:
                key = str(response.status_code)
                async for _ in response.aiter_bytes():
                    if hang_up or over():
                        key = "hung_up"
                        break
        except httpx.HTTPError:
            key = "error"
        except Exception as exc:  # a load generator that dies silently would fake a calm
            key = f"error:{type(exc).__name__}"
        counts[key] = counts.get(key, 0) + 1
        if key in ("429", "503") or key.startswith("error"):
            await asyncio.sleep(0.05)
