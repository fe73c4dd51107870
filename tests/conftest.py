"""Shared fixtures: a small fake OpenAI-compatible engine and a gateway, both real servers.

`FakeEngine` speaks HTTP/1.1 over raw asyncio streams so that a test can see exactly what
an engine sees: every request's headers and body, when its connection was closed by the
client (that is how vLLM notices an abort), how many chunks it had sent by then. It can
stream N chunks at an interval, answer after a delay, crash mid-stream, hang, or answer
with an error status; tests choose per request with a `"fake"` object in the JSON body
(the gateway relays unknown fields untouched), or per engine through the constructor.

`gateway_factory` starts kvgate's real ASGI app under uvicorn (or hypercorn) on an
ephemeral 127.0.0.1 port, and checks after the test that its in-flight gauge went back to
zero and that the policy holds no ticket: a leak fails the test that caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

# ---- the fake engine -------------------------------------------------------------------------


@dataclass(slots=True)
class EngineRequest:
    """What the engine saw of one request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float
    request_id: str | None
    chunks_sent: int = 0
    closed_by_client_at: float | None = None
    completed_at: float | None = None

    @property
    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None


@dataclass
class FakeEngine:
    """A fake engine on 127.0.0.1. Defaults apply when a request's `"fake"` omits them.

    Per-request knobs (`"fake": {...}` in the body): `chunks` (number of token events),
    `interval` (seconds between events, or the non-streaming think time per token),
    `delay` (before the response headers), `crash_after` (close the socket after that many
    events, abruptly), `hang_after` (stop sending after that many events), `status`
    (answer this error status with an OpenAI error body), `usage` (send a final usage event),
    `pad` (characters added to each streamed token's text, to make big streams), `split`
    (write each event in two pieces cut after that many bytes, 5 ms apart, so that a
    reader gets them in separate reads: 2 cuts `data:` itself).
    """

    model: str = "fake-model"
    chunks: int = 5
    interval: float = 0.0
    models: list[str] = field(default_factory=list)
    requests: list[EngineRequest] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"  # any of 127.0.0.0/8: several engines may share one port
    kv_usage: float = 0.1
    metrics_delay: float = 0.0  # seconds before /metrics answers (a busy engine's page)
    metrics_hits: int = 0  # GETs of /metrics (not kept in `requests`)
    _server: asyncio.base_events.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def by_id(self, request_id: str) -> EngineRequest:
        matches = [r for r in self.requests if r.request_id == request_id]
        assert matches, f"the engine never saw request {request_id}"
        return matches[-1]

    def completions(self) -> list[EngineRequest]:
        return [r for r in self.requests if r.path.startswith("/v1/") and r.method == "POST"]

    async def wait_closed(self, request_id: str, within: float = 2.0) -> EngineRequest:
        """Wait (bounded) until the client closed `request_id`'s connection."""

        def closed() -> bool:
            found = [r for r in self.requests if r.request_id == request_id]
            return bool(found) and found[-1].closed_by_client_at is not None

        if not await eventually(closed, within):
            raise AssertionError(f"the engine never saw {request_id} closed")
        return self.by_id(request_id)

    # ---- HTTP ------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                keep = await self._dispatch(request, reader, writer)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._handlers.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _dispatch(
        self, req: EngineRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        if req.path == "/health":
            return await _send(writer, 200, b"", "text/plain")
        if req.path == "/metrics":
            self.metrics_hits += 1
            if self.metrics_delay:
                await asyncio.sleep(self.metrics_delay)
            return await _send(writer, 200, self._metrics_page(), "text/plain; version=0.0.4")
        self.requests.append(req)
        if req.path == "/v1/models":
            names = [self.model, *self.models]
            data = [{"id": n, "object": "model", "owned_by": "fake"} for n in names]
            return await _send(writer, 200, orjson.dumps({"object": "list", "data": data}))
        if req.path in ("/v1/completions", "/v1/chat/completions"):
            return await self._completion(req, reader, writer)
        body = orjson.dumps({"path": req.path, "echo": req.body.decode("utf-8", "replace")})
        if req.method == "HEAD":  # the length of the body a GET would get, and no body
            writer.write(
                f"HTTP/1.1 200 X\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n".encode()
            )
            await writer.drain()
            return True
        return await _send(writer, 200, body)

    def _metrics_page(self) -> bytes:
        running = sum(
            1 for r in self.requests if r.completed_at is None and r.closed_by_client_at is None
        )
        labels = f'engine="0",model_name="{self.model}"'
        return (
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_usage}\n"
            f"vllm:num_requests_running{{{labels}}} {running}\n"
            f"vllm:num_requests_waiting{{{labels}}} 0\n"
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1024"}} 1.0\n'
        ).encode()

    async def _completion(
        self, req: EngineRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        try:
            body = req.json or {}
        except orjson.JSONDecodeError:
            return await _send(writer, 400, b'{"error": {"message": "bad json"}}')
        knobs = body.get("fake") or {}
        chunks = int(knobs.get("chunks", self.chunks))
        interval = float(knobs.get("interval", self.interval))
        delay = float(knobs.get("delay", 0.0))
        status = int(knobs.get("status", 200))
        # Watch the client's side of the connection: EOF there is the abort.
        closed = asyncio.create_task(_wait_eof(reader))
        try:
            if delay and await _closed_within(closed, delay, req):
                return False
            if status != 200:
                error = {"error": {"message": "fake failure", "type": "x", "code": status}}
                return await _send(writer, status, orjson.dumps(error), keep_alive=False)
            if body.get("stream"):
                return await self._stream(req, body, knobs, chunks, interval, closed, writer)
            if chunks and interval and await _closed_within(closed, chunks * interval, req):
                return False
            text = "".join(f"t{i} " for i in range(chunks))
            usage = {"prompt_tokens": 7, "completion_tokens": chunks, "total_tokens": 7 + chunks}
            answer = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                      "usage": usage}  # fmt: skip
            req.completed_at = time.monotonic()
            return await _send(writer, 200, orjson.dumps(answer), keep_alive=False)
        finally:
            closed.cancel()

    async def _stream(
        self,
        req: EngineRequest,
        body: dict[str, Any],
        knobs: dict[str, Any],
        chunks: int,
        interval: float,
        closed: asyncio.Task[None],
        writer: asyncio.StreamWriter,
    ) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\nconnection: close\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        crash_after = knobs.get("crash_after")
        hang_after = knobs.get("hang_after")
        pad = "x" * int(knobs.get("pad", 0))
        for i in range(chunks):
            if crash_after is not None and i >= int(crash_after):
                writer.transport.abort()
                return False
            if hang_after is not None and i >= int(hang_after):
                await _closed_within(closed, 3600, req)
                return False
            if interval and await _closed_within(closed, interval, req):
                return False
            if closed.done():
                req.closed_by_client_at = req.closed_by_client_at or time.monotonic()
                return False
            choice = {"index": 0, "text": f"t{i} " + pad, "finish_reason": None}
            event = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                     "choices": [choice]}  # fmt: skip
            data = b"data: " + orjson.dumps(event) + b"\n\n"
            split = int(knobs.get("split", 0))
            if split:
                _chunk(writer, data[:split])
                await writer.drain()
                await asyncio.sleep(0.005)
                data = data[split:]
            _chunk(writer, data)
            req.chunks_sent += 1
            await writer.drain()
        if knobs.get("usage", True):
            usage = {"prompt_tokens": 7, "completion_tokens": chunks, "total_tokens": 7 + chunks}
            final = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                     "choices": [], "usage": usage}  # fmt: skip
            _chunk(writer, b"data: " + orjson.dumps(final) + b"\n\n")
        _chunk(writer, b"data: [DONE]\n\n")
        req.completed_at = time.monotonic()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return False


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def _wait_eof(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


async def _closed_within(closed: asyncio.Task[None], seconds: float, req: EngineRequest) -> bool:
    """Sleep `seconds` unless the client closes first (then record it and say so)."""
    done, _ = await asyncio.wait({closed}, timeout=seconds)
    if done:
        req.closed_by_client_at = time.monotonic()
        return True
    return False


async def _read_request(reader: asyncio.StreamReader) -> EngineRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    received = time.monotonic()
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or 0)
    body = await reader.readexactly(length) if length else b""
    return EngineRequest(
        method=method,
        path=path.split("?", 1)[0],
        headers=headers,
        body=body,
        received_at=received,
        request_id=headers.get("x-request-id"),
    )


async def _send(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "application/json",
    *,
    keep_alive: bool = True,
) -> bool:
    close = "" if keep_alive else "connection: close\r\n"
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\n{close}"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    return keep_alive


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


async def eventually(predicate: Callable[[], bool], within: float = 2.0) -> bool:
    """Poll `predicate` every 2 ms for at most `within` seconds; its last value."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.002)
    return True


def free_port() -> int:
    """A port nothing listens on right now (for "connection refused")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


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

    Dotted keyword overrides go to `load_config` (e.g. `**{"upstream.read_timeout_s": 0.2}`).
    After the test, every gateway must be back to zero requests in flight and zero tickets.
    """
    from kvgate.config import load_config
    from kvgate.gateway.app import Gateway
    from kvgate.gateway.http.server import GatewayServer, bind_socket

    running: list[RunningGateway] = []

    async def make(
        backends: list[str],
        *,
        policy: Any = None,
        server: str = "uvicorn",
        overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> RunningGateway:
        settings = {
            "backends": [{"url": u} for u in backends],
            "server.server": server,
            "server.log_level": "warning",
            "admission.policy": "none",
            "scrape.interval_s": 0.1,
            **(overrides or {}),
        }
        config = load_config(None, **settings)
        gateway = Gateway(config, policy=policy, **kwargs)
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        srv = GatewayServer(gateway)
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
            tickets = handle.gateway.policy.snapshot().get("in_flight_requests", 0)
            if tickets:
                leaks.append(f"{handle.url}: {tickets} ticket(s) never released")
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
