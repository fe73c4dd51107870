"""A fake OpenAI-compatible engine on 127.0.0.1, for the tests and the benchmarks.

`FakeEngine` speaks HTTP/1.1 over raw asyncio streams so that a caller can see exactly what
an engine sees: every request's headers and body, when its connection was closed by the
client (that is how vLLM notices an abort), how many chunks it had sent by then and when
each was written. It can stream N chunks at an interval, answer after a delay, crash
mid-stream, hang, or answer with an error status; a caller chooses per request with a
`"fake"` object in the JSON body (the gateway relays unknown fields untouched), or per
engine through the constructor. It serves a vLLM-shaped `/metrics` page, so the gateway's
scraper treats it as a live vLLM node, and like vLLM's default server it has no abort API
(404): closing the connection is the abort. With `tokenize` it serves vLLM's `/tokenize`
(a token per 4 characters of text, after `tokenize_delay`); without, that path is a 404, as
on an engine that lacks it. Other paths are echoed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvgate.adapters.vllm import ABORT_PATH as VLLM_ABORT_PATH
from kvgate.testing.polling import eventually


@dataclass(slots=True)
class EngineRequest:
    """What the engine saw of one request."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float
    request_id: str | None
    chunk_times: list[float] = field(default_factory=list)  # when each token event was written
    closed_by_client_at: float | None = None  # when the engine read end-of-file from the client
    completed_at: float | None = None
    # When the engine stopped handling a completion (answered, cut, or given up on its
    # departed client): nothing more is sent for it after this.
    handled_at: float | None = None

    @property
    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None

    @property
    def chunks_sent(self) -> int:
        return len(self.chunk_times)


# 1,024 blocks of 16 tokens, as the metrics page's cache_config_info says.
KV_CAPACITY_TOKENS = 16384


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
    # The context length `/v1/models` lists for every model, as vLLM does (None: not
    # listed, as by engines that do not say). The fake engine enforces nothing with it.
    max_model_len: int | None = None
    requests: list[EngineRequest] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"  # any of 127.0.0.0/8: several engines may share one port
    kv_usage: float = 0.1
    # Report KV usage as a real engine does: `kv_usage` plus the tokens of the requests it
    # runs (a token-id prompt counts its ids, a text prompt a token per 4 characters, and
    # each token event sent), against its 16,384-token cache. Off: `kv_usage` alone.
    kv_from_requests: bool = False
    metrics_delay: float = 0.0  # seconds before /metrics answers (a busy engine's page)
    metrics_hits: int = 0  # GETs of /metrics (not kept in `requests`)
    # While set, /metrics GETs get no answer, and those asked meanwhile never do (each
    # hangs until its client closes it): a page that hung, whose lost GETs stay lost.
    metrics_hung: bool = False
    tokenize: bool = False  # serve vLLM's /tokenize (else 404 there)
    tokenize_delay: float = 0.0  # seconds before /tokenize answers
    tls: ssl.SSLContext | None = None  # a server context: the engine serves HTTPS
    _server: asyncio.base_events.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> FakeEngine:
        self._server = await asyncio.start_server(
            self._connection, self.host, self.port, ssl=self.tls
        )
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
            if self.metrics_hung:
                await reader.read()  # until the client hangs up
                return False
            if self.metrics_delay:
                await asyncio.sleep(self.metrics_delay)
            return await _send(writer, 200, self._metrics_page(), "text/plain; version=0.0.4")
        self.requests.append(req)
        if req.path == VLLM_ABORT_PATH:  # like vLLM started without --enable-scale-out
            return await _send(writer, 404, b'{"detail": "Not Found"}')
        if req.path == "/tokenize":
            return await self._tokenize(req, writer)
        if req.path == "/v1/models":
            names = [self.model, *self.models]
            data: list[dict[str, Any]] = [
                {"id": n, "object": "model", "owned_by": "fake"} for n in names
            ]
            if self.max_model_len is not None:
                data = [{**entry, "max_model_len": self.max_model_len} for entry in data]
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

    async def _tokenize(self, req: EngineRequest, writer: asyncio.StreamWriter) -> bool:
        """vLLM's `/tokenize`: a token per 4 characters of the prompt (chat: of each
        message's content, plus 4 for its role markers); the ids count up from 100."""
        if not self.tokenize:
            return await _send(writer, 404, b'{"detail": "Not Found"}')
        if self.tokenize_delay:
            await asyncio.sleep(self.tokenize_delay)
        body = req.json or {}
        if "messages" in body:
            count = sum(len(str(m.get("content") or "")) // 4 + 4 for m in body["messages"])
        else:
            count = len(str(body.get("prompt", ""))) // 4
        tokens = list(range(100, 100 + count))
        answer = {"count": count, "max_model_len": self.max_model_len or 2048, "tokens": tokens}
        return await _send(writer, 200, orjson.dumps(answer))

    def _metrics_page(self) -> bytes:
        running = sum(
            1 for r in self.requests if r.completed_at is None and r.closed_by_client_at is None
        )
        labels = f'engine="0",model_name="{self.model}"'
        usage = self.kv_usage
        if self.kv_from_requests:
            live = (r for r in self.completions() if r.completed_at is None)
            held = sum(_tokens(r) for r in live if r.closed_by_client_at is None)
            usage = min(1.0, usage + held / KV_CAPACITY_TOKENS)
        return (
            f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n"
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
        closed = asyncio.create_task(_wait_eof(reader, req))
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
            req.handled_at = time.monotonic()

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
            req.chunk_times.append(time.monotonic())
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


def _tokens(req: EngineRequest) -> int:
    """The KV tokens a running request holds: its prompt and the tokens sent so far."""
    try:
        body = req.json or {}
    except orjson.JSONDecodeError:
        return 0
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        count = len(prompt)
    else:
        messages = body.get("messages") or []
        text = str(prompt) + "".join(
            str(m.get("content", "")) for m in messages if isinstance(m, dict)
        )
        count = len(text) // 4
    return count + req.chunks_sent


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def _wait_eof(reader: asyncio.StreamReader, req: EngineRequest) -> None:
    """Return at end-of-file from the client, stamping it on `req` unless `req` had been
    answered whole (a client that closes after its answer is no abort)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass
    if req.completed_at is None and req.closed_by_client_at is None:
        req.closed_by_client_at = time.monotonic()


async def _closed_within(closed: asyncio.Task[None], seconds: float, req: EngineRequest) -> bool:
    """Sleep `seconds` unless the client closes first (then record it and say so)."""
    done, _ = await asyncio.wait({closed}, timeout=seconds)
    if done:
        req.closed_by_client_at = req.closed_by_client_at or time.monotonic()
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
