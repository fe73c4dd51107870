"""Shared fixtures: fake engines (`kvgate.testing.FakeEngine`) and a gateway, both real servers.

`gateway_factory` starts kvgate's real ASGI app under uvicorn (or hypercorn) on an
ephemeral 127.0.0.1 port, and checks after the test that its in-flight gauge went back to
zero, that the admission core holds no ticket and that nothing waits in its queue: a leak
fails the test that caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvgate.core.clock import MonotonicClock
from kvgate.core.policies.baselines import BaselineOptions, build_named
from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer
from kvgate.testing import FakeEngine, eventually, free_port


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = await FakeEngine().start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
async def engine_factory() -> AsyncIterator[Callable[..., Any]]:
    """Start more fake engines: `await engine_factory(model="m", chunks=3)`."""
    engines: list[FakeEngine] = []

    async def make(**kwargs: Any) -> FakeEngine:
        engine = await FakeEngine(**kwargs).start()
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in engines:
            await engine.stop()


@pytest.fixture
async def sim_server() -> AsyncIterator[SimServer]:
    """The engine simulator (`kvgate sim`'s server, the tiny CPU preset) on 127.0.0.1."""
    server = SimServer(Engine(CPU_TINY, seed=0), model_name="sim-llama")
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()


@pytest.fixture
def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1, self-signed, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


# ---- the gateway -----------------------------------------------------------------------------


@dataclass
class RunningGateway:
    """A gateway serving on 127.0.0.1; `gateway` is the live `kvgate.gateway.app.Gateway`."""

    url: str
    gateway: Any
    server: Any
    task: asyncio.Task[None]

    @property
    def in_flight(self) -> int:
        return int(self.gateway.metrics.in_flight)


@pytest.fixture
async def gateway_factory() -> AsyncIterator[Callable[..., Any]]:
    """`await gateway_factory([engine.url, ...], policy=..., server="hypercorn", **{"a.b": v})`.

    `policy` is a policy, or the name of one (`kvgate.core.policies.baselines`, built on the
    gateway's clock with the quotas `baseline`): `none` unless a test says otherwise.
    Dotted keyword overrides go to `load_config` (e.g. `**{"upstream.read_timeout_s": 0.2}`);
    `connection_limits` (kvgate.gateway.http.guard.ConnectionLimits) shortens the guard's.
    After the test, every gateway must be back to zero requests in flight, zero tickets and
    an empty queue.
    """
    from kvgate.config import load_config
    from kvgate.gateway.app import Gateway
    from kvgate.gateway.http.server import GatewayServer, bind_socket

    running: list[RunningGateway] = []

    async def make(
        backends: list[str],
        *,
        policy: Any = "none",
        baseline: BaselineOptions | None = None,
        server: str = "uvicorn",
        overrides: dict[str, Any] | None = None,
        connection_limits: Any = None,
        **kwargs: Any,
    ) -> RunningGateway:
        settings = {
            "backends": [{"url": u} for u in backends],
            "server.server": server,
            "server.log_level": "warning",
            "scrape.interval_s": 0.1,
            **(overrides or {}),
        }
        config = load_config(None, **settings)
        if isinstance(policy, str):
            clock = kwargs.setdefault("clock", MonotonicClock())
            policy = build_named(policy, config.admission, clock, options=baseline)
        gateway = Gateway(config, policy=policy, **kwargs)
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        srv = GatewayServer(gateway, connection_limits=connection_limits)
        task = asyncio.create_task(srv.serve(sock, handle_signals=False))
        scheme = "https" if config.server.certfile else "http"
        handle = RunningGateway(f"{scheme}://127.0.0.1:{port}", gateway, srv, task)
        running.append(handle)
        await _wait_healthy(handle)
        return handle

    try:
        yield make
    finally:
        leaks: list[str] = []
        for handle in running:
            await eventually(lambda h=handle: h.in_flight == 0, 2.0)
            if handle.in_flight:
                leaks.append(f"{handle.url}: {handle.in_flight} request(s) still in flight")
            snap = handle.gateway.admission.snapshot()
            tickets = snap["in_flight_requests"]
            if tickets:
                leaks.append(f"{handle.url}: {tickets} ticket(s) never released")
            waiting = snap["queue"]["waiting"]
            if waiting:
                leaks.append(f"{handle.url}: {waiting} request(s) still queued")
            handle.server.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(handle.task, 10)
        assert not leaks, "; ".join(leaks)


async def _wait_healthy(handle: RunningGateway, within: float = 10.0) -> None:
    scheme, _, address = handle.url.partition("://")
    host, _, port = address.rpartition(":")
    context = None
    if scheme == "https":  # the tests' self-signed certificate: no verification
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if handle.task.done():
            handle.task.result()
            raise AssertionError("the gateway exited during startup")
        try:
            reader, writer = await asyncio.open_connection(host, int(port), ssl=context)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        await writer.drain()
        data = await reader.read()
        writer.close()
        if data.startswith(b"HTTP/1.1 200") or data.startswith(b"HTTP/1.0 200"):
            if handle.gateway.pool._session is not None:
                return
        await asyncio.sleep(0.02)
    raise AssertionError("the gateway did not become healthy")
