"""A lean HTTP/1.1 client for the hot path: keep-alive pool, httptools parser, raw bytes.

Why not aiohttp here: measured on these machines, one small request costs ~210-250 µs of
client CPU through `aiohttp.ClientSession` and ~22-35 µs through this client (the same
engine, 16 keep-alive connections; `benchmarks/proxy_overhead/results.md`). aiohttp builds
a URL object, multidicts, a request object, a writer task, a payload and a stream reader per
request; a relay needs none of that. Headers stay the bytes ASGI gave us, the parser is the
same C parser uvicorn uses, and a response body is a queue of bytes with back-pressure
(reading from the engine pauses while more than `HIGH_WATER` bytes wait for the client),
or, spliced (`H1Response.splice`), handed to a callback once per socket read.

The relay and the scraper use it; aiohttp serves what is off the hot path (model lists,
abort calls). HTTPS engines are reached with the system's CA certificates.

Faults map onto the relay's two kinds: nothing received yet (refused, reset, closed) is an
`UpstreamConnectError` (retryable on another backend); a body cut short (the connection
dropped before a chunked or sized body was complete) raises `UpstreamError("reset")`.
A pooled connection the engine had closed while idle is retried once on a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Sequence
from typing import cast
from urllib.parse import urlsplit

import httptools

from kvgate.gateway.http.errors import UpstreamConnectError, UpstreamError

#: Buffered body bytes above which reading from the engine pauses (back-pressure).
HIGH_WATER = 256 * 1024
#: Idle connections kept per backend; more are closed when released.
MAX_IDLE_PER_BACKEND = 512


class H1Response:
    """One response: status and raw headers once they came, then body bytes as they come."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_complete",
        "_conn",
        "_ended",
        "_error",
        "_sink",
        "_waiter",
        "delimited",
        "raw_headers",
        "status",
    )

    def __init__(self, conn: H1Connection) -> None:
        self._conn = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.delimited = False  # a content-length or chunked body (else: until close)
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._ended: asyncio.Future[Exception | None] | None = None

    @property
    def content_type(self) -> str:
        for name, value in self.raw_headers:
            if name.lower() == b"content-type":
                return value.decode("latin-1")
        return ""

    async def readany(self) -> bytes:
        """Whatever body bytes arrived (all of them, joined); b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take()

    def take(self) -> bytes:
        """The body bytes buffered so far, joined (b"" when none)."""
        data = self._joined()
        if self._buffered > HIGH_WATER:
            self._conn.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        if self._complete and self._error is None:  # all here already: no await, no join
            return self.take()
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def splice(self, sink: Callable[[bytes], None]) -> asyncio.Future[Exception | None]:
        """Hand every body read to `sink` from the connection's callback, as it arrives,
        instead of queueing it for `readany()` (see kvgate.gateway.http.splice).

        The future ends with the body: None when it was complete, else the error that cut
        it, including an exception `sink` raised (the connection is then closed).
        """
        ended = self._conn.loop.create_future()
        self._ended = ended
        self._buffered = 0
        self._sink = sink
        self._conn.resume_reading()  # in case `readany()` had paused it
        self._flush()  # what came with the headers
        if self._error is not None or self._complete:
            self._settle()
        return ended

    def pause(self) -> None:
        """Stop reading from the engine (a spliced stream's client is slow)."""
        self._conn.pause_reading()

    def resume(self) -> None:
        self._conn.resume_reading()

    def release(self) -> None:
        """Give the connection back to the pool if the body was read whole, else close it."""
        self._conn.finished(self)

    def close(self) -> None:
        """Drop the connection now: for vLLM a closed connection is the abort."""
        self._conn.abort()

    # -- fed by the connection ------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _joined(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        return data

    def _settle(self) -> None:
        # The sink (the relay's callback) holds this response: dropping it here, at the
        # body's end, keeps each stream's objects free of a reference cycle.
        self._sink = None
        ended, self._ended = self._ended, None
        if ended is not None and not ended.done():
            ended.set_result(self._error)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        if self._sink is not None:
            return  # handed over whole when the read is parsed (`_flush`)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause_reading()
        self._wake()

    def _flush(self) -> None:
        """Hand a spliced response's parsed bytes to its sink: once per socket read, not
        once per HTTP chunk (an engine sending fast puts many events in one read)."""
        sink = self._sink
        if sink is None or not self._chunks:
            return
        try:
            sink(self._joined())
        except Exception as exc:  # a relay fault: end this response, never the parser
            self._fail(exc)
            self._conn.abort()

    def _end(self) -> None:
        self._flush()
        self._complete = True
        self._wake()
        self._settle()

    def _fail(self, error: Exception) -> None:
        if not self._complete and self._error is None:
            self._error = error
        self._wake()
        self._settle()  # drops the sink: nothing more is relayed


class _NoCallbacks:
    """The callbacks of a closed connection's parser: none."""


class H1Connection(asyncio.Protocol):
    """One keep-alive connection; serves one request at a time (no pipelining)."""

    def __init__(self, pool: H1Pool, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: H1Response | None = None
        self.headers_future: asyncio.Future[H1Response] | None = None
        self.closed = False
        self.used = False
        self.keep_alive = False
        self.head = False  # a HEAD request: its response has no body, whatever it says
        self._paused = False

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not `asyncio.Transport` subclasses, only look-alikes.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(UpstreamError("protocol", f"invalid HTTP from {self.key}: {exc}"))
            return
        response = self.response
        if response is not None and response._sink is not None:
            response._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is None:
            self._unlink()
            return
        if self.headers_future is not None and not self.headers_future.done():
            self.headers_future.set_exception(
                UpstreamConnectError("reset", f"{self.key} closed the connection before answering")
            )
        elif not response.delimited:
            response._end()  # a body delimited by the close itself
        else:
            response._fail(UpstreamError("reset", f"{self.key} closed the connection mid-body"))
        self._unlink()

    def _unlink(self) -> None:
        """The parser holds this protocol (its callbacks): a fresh one that does not, so a
        closed connection is freed by reference counting rather than by the collector
        (a new parser costs ~0.4 µs, timeit, once per closed connection)."""
        self.parser = httptools.HttpResponseParser(_NoCallbacks())

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length" or (
            lowered == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.response.delimited = True

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        status = self.parser.get_status_code()
        if status < 200:  # 1xx interim answers: wait for the real one
            response.raw_headers.clear()
            return
        response.status = status
        # Asked now: after the message completes the parser has reset its flags.
        self.keep_alive = self.parser.should_keep_alive()
        if status in (204, 304):
            response.delimited = True
        if self.head:
            # httptools cannot be told that a HEAD response has no body: end it here and
            # never reuse the connection, whose parser would wait for that body.
            self.keep_alive = False
            response.delimited = True
            response._end()
        if self.headers_future is not None and not self.headers_future.done():
            self.headers_future.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        if self.response is not None and self.response.status >= 200:
            self.response._end()

    # -- used by the pool and the response --------------------------------------------------

    async def send(self, head: bytes, body: bytes, *, is_head: bool = False) -> H1Response:
        """Write one request and wait for its response headers."""
        assert self.transport is not None
        self.used = True
        self.keep_alive = False
        self.head = is_head
        self.response = H1Response(self)
        self.headers_future = self.loop.create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)
        try:
            return await self.headers_future
        except BaseException:
            self.abort()
            raise

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def finished(self, response: H1Response) -> None:
        if (
            response is self.response
            and response._complete
            and not response._chunks
            and not self.closed
            and self.keep_alive
        ):
            self.response = None
            self.headers_future = None
            self.resume_reading()
            self.pool.put_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        response, self.response = self.response, None
        self.headers_future = None  # its result, the response, would hold this connection
        if response is not None:  # unlinked both ways: no reference cycle to collect
            response._fail(UpstreamError("closed", "the upstream response was closed"))

    def _broken(self, error: UpstreamError) -> None:
        if self.headers_future is not None and not self.headers_future.done():
            self.headers_future.set_exception(error)
        elif self.response is not None:
            self.response._fail(error)
        self.abort()


class H1Pool:
    """Idle keep-alive connections per backend base URL, and new ones when none is idle."""

    def __init__(
        self,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> None:
        self._idle: dict[str, collections.deque[H1Connection]] = {}
        self._origins: dict[str, tuple[str, int, str, str, bool]] = {}
        self._connect_timeout_s = connect_timeout_s
        self._ssl: ssl.SSLContext | None = ssl_context
        self._closed = False
        # Whether a connection given back to a base URL is kept for later requests: not
        # when its backend was removed meanwhile (None: always kept).
        self._keep = keep

    async def request(
        self,
        base_url: str,
        method: str,
        target: str,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> H1Response:
        """Send one request to `base_url` + `target`; returns once its headers arrived."""
        host, port, prefix, netloc, tls = self._origin(base_url)
        head = [
            f"{method} {prefix}{target} HTTP/1.1\r\nhost: {netloc}\r\n".encode("latin-1"),
        ]
        for name, value in headers:
            head.append(name + b": " + value + b"\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        data = b"".join(head)
        idle = self._idle.get(base_url)
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            try:
                return await conn.send(data, body, is_head=method == "HEAD")
            except UpstreamConnectError:
                break  # closed while idle: once more on a fresh connection
        conn = await self._connect(base_url, host, port, tls)
        return await conn.send(data, body, is_head=method == "HEAD")

    def _origin(self, base_url: str) -> tuple[str, int, str, str, bool]:
        """(host, port, path prefix, netloc, TLS?) of a base URL, split once per backend
        rather than once per request (~1.5 µs of `urlsplit` and its properties each time)."""
        origin = self._origins.get(base_url)
        if origin is None:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            origin = (
                parts.hostname or "localhost",
                parts.port or (443 if tls else 80),
                parts.path.rstrip("/"),
                parts.netloc,
                tls,
            )
            self._origins[base_url] = origin
        return origin

    async def _connect(self, key: str, host: str, port: int, tls: bool) -> H1Connection:
        loop = asyncio.get_running_loop()
        context = self._ssl_context() if tls else None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: H1Connection(self, key, loop), host, port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError("connect", f"connecting to {key} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError("connect", f"cannot connect to {key}: {exc}") from None
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def put_back(self, conn: H1Connection) -> None:
        if self._closed or (self._keep is not None and not self._keep(conn.key)):
            conn.abort()
            return
        idle = self._idle.setdefault(conn.key, collections.deque())
        if len(idle) >= MAX_IDLE_PER_BACKEND:
            conn.abort()
            return
        idle.append(conn)

    def close_idle(self, base_url: str) -> None:
        """Close the idle connections to `base_url` and forget it (a removed backend);
        busy ones close when they are given back, if `keep` says so."""
        self._origins.pop(base_url, None)
        idle = self._idle.pop(base_url, None)
        while idle:
            idle.pop().abort()

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().abort()
