"""A lean HTTP/1.1 GET client for metrics pages, and an aiohttp-backed alternative.

Why not aiohttp for scraping: a GET through `aiohttp.ClientSession` costs about twice the
CPU of a bare asyncio-streams GET and several times the parse of a 53 KB vLLM page; at 20
scrapes per second per node that is what limits how many nodes one process can watch.
This client keeps one persistent connection per engine, writes a fixed request and reads
a Content-Length or chunked body with asyncio streams (numbers:
`benchmarks/scrape_cost/results.md`). It only does what
a metrics scrape needs: GET, keep-alive, HTTP or HTTPS, no redirects, no proxies, no
compression (it asks for `identity`). Anything else is an error, and the node goes stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

from kvgate.adapters.base import MAX_PAGE_BYTES

_MAX_HEADER_BYTES = 64 * 1024


class ScrapeError(Exception):
    """A scrape that produced no page: HTTP status, oversized or malformed response."""


class MetricsFetcher(Protocol):
    """What the scraper needs from HTTP: the body of a 200 answer to a GET, or an error."""

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str
    port: int
    request_head: bytes  # request line + fixed headers, without the per-call ones


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ScrapeError(f"unsupported metrics URL {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    host_header = host if parts.port is None else f"{host}:{port}"
    head = (
        f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: kvgate-scraper\r\n"
        "Accept: text/plain;version=0.0.4, */*;q=0.1\r\nAccept-Encoding: identity\r\n"
    ).encode("latin-1")
    return _Target(parts.scheme, parts.hostname, port, head)


class _Connection:
    __slots__ = ("reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.used = reader, writer, False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class LeanHttpFetcher:
    """One persistent connection per metrics URL; a failed or timed-out GET drops it.

    Not for concurrent use on one URL: the scraper polls each node sequentially. The
    caller bounds each `get` with its own timeout (cancellation closes the connection).
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._targets: dict[str, _Target] = {}
        self._conns: dict[str, _Connection] = {}

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _target(url)
        request = target.request_head + b"".join(
            f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()
        )
        request += b"\r\n"
        conn = self._conns.pop(url, None)
        if conn is not None:
            try:
                return await self._exchange(url, conn, request)
            except (ConnectionError, asyncio.IncompleteReadError, _StaleConnection):
                pass  # the engine closed the idle keep-alive connection: retry once, fresh
        conn = await self._connect(target)
        return await self._exchange(url, conn, request)

    async def _connect(self, target: _Target) -> _Connection:
        ssl_arg: ssl.SSLContext | None = None
        if target.scheme == "https":
            ssl_arg = self._ssl or ssl.create_default_context()
        reader, writer = await asyncio.open_connection(
            target.host, target.port, ssl=ssl_arg, limit=_MAX_HEADER_BYTES
        )
        return _Connection(reader, writer)

    async def _exchange(self, url: str, conn: _Connection, request: bytes) -> bytes:
        reused = conn.used
        conn.used = True
        keep = False
        try:
            conn.writer.write(request)
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if reused and not exc.partial:
                    raise _StaleConnection from None
                raise ScrapeError("connection closed before the response headers") from None
            except asyncio.LimitOverrunError:
                raise ScrapeError("response headers too large") from None
            status, fields = _parse_head(head)
            if status != 200:
                raise ScrapeError(f"HTTP {status}")
            body = await _read_body(conn.reader, fields)
            keep = fields.get("connection", "").lower() != "close"
            return body
        finally:
            if keep:
                self._conns[url] = conn
            else:
                conn.close()

    async def close(self) -> None:
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            conn.close()


class _StaleConnection(Exception):
    """A reused keep-alive connection that the server had already closed."""


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
        raise ScrapeError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    try:
        status = int(status_line[1])
    except ValueError:
        raise ScrapeError(f"bad status line {lines[0][:60]!r}") from None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return status, fields


async def _read_body(reader: asyncio.StreamReader, fields: Mapping[str, str]) -> bytes:
    encoding = fields.get("content-encoding", "identity").lower()
    if encoding not in ("", "identity"):
        raise ScrapeError(f"unexpected content-encoding {encoding!r}")
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    length = fields.get("content-length")
    if length is None:
        raise ScrapeError("response has neither Content-Length nor chunked encoding")
    try:
        size = int(length)
    except ValueError:
        raise ScrapeError(f"bad Content-Length {length[:20]!r}") from None
    if size < 0:
        raise ScrapeError(f"bad Content-Length {length[:20]!r}")
    if size > MAX_PAGE_BYTES:
        raise ScrapeError(f"page of {size} bytes is too large")
    return await reader.readexactly(size)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ScrapeError("malformed chunk size") from None
        if size < 0:
            raise ScrapeError("malformed chunk size")
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        total += size
        if total > MAX_PAGE_BYTES:
            raise ScrapeError(f"page larger than {MAX_PAGE_BYTES} bytes")
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise ScrapeError("malformed chunk")
        parts.append(chunk[:-2])


class AiohttpFetcher:
    """The same contract through aiohttp, for setups the lean client does not cover (HTTP
    proxies from the environment, compressed pages). Uses the caller's session when given
    (the caller closes it), else its own, opened on first use and closed by `close()`."""

    def __init__(self, session: aiohttp.ClientSession | None = None) -> None:
        self._session = session
        self._owned: aiohttp.ClientSession | None = None

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes:
        session = self._session
        if session is None:
            if self._owned is None:
                self._owned = aiohttp.ClientSession(trust_env=True)
            session = self._owned
        async with session.get(url, headers=dict(headers), allow_redirects=False) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            if (resp.content_length or 0) > MAX_PAGE_BYTES:
                raise ScrapeError(f"page of {resp.content_length} bytes is too large")
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.content.iter_chunked(256 * 1024):
                size += len(chunk)
                if size > MAX_PAGE_BYTES:
                    raise ScrapeError(f"page larger than {MAX_PAGE_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    async def close(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None:
            await owned.close()
