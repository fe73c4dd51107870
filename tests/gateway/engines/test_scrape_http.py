"""The lean metrics client against raw HTTP servers on 127.0.0.1 that answer in every way a
metrics endpoint might: Content-Length, chunked, Connection: close, idle-close, errors, TLS."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from adapters.pages import page
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.gateway.engines.scrape_http import LeanHttpFetcher, ScrapeError

PAGE = page("vllm")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """Answers each request on a connection with `self.reply(n)` bytes (n: request count)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.reply: Callable[[int], bytes] = lambda n: ok(PAGE)
        self.close_after_each = False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                writer.write(self.reply(len(self.requests)))
                await writer.drain()
                if self.close_after_each:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"


@pytest.fixture
async def raw() -> AsyncIterator[tuple[RawServer, str]]:
    server = RawServer()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}/metrics?x=1"
    finally:
        srv.close()


async def test_keep_alive_and_request_shape(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    fetcher = LeanHttpFetcher()
    try:
        for _ in range(5):
            assert await fetcher.get(url, {"Authorization": "Bearer k"}) == PAGE
    finally:
        await fetcher.close()
    assert server.connections == 1  # one connection, reused
    first = server.requests[0]
    assert first.startswith(b"GET /metrics?x=1 HTTP/1.1\r\n")
    assert b"host: 127.0.0.1:" in first.lower() and b"Authorization: Bearer k\r\n" in first
    assert b"accept-encoding: identity" in first.lower()


async def test_chunked_bodies(raw: tuple[RawServer, str]) -> None:
    server, url = raw
    server.reply = lambda n: chunked(PAGE, 777 * n)
    fetcher = LeanHttpFetcher()
    try:
        assert await fetcher.get(url, {}) == PAGE
        assert await fetcher.get(url, {}) == PAGE
    finally:
        await fetcher.close()
    assert server.connections == 1


async def test_connection_close_and_idle_close_are_transparent(
    raw: tuple[RawServer, str],
) -> None:
    server, url = raw
    fetcher = LeanHttpFetcher()
    try:
        server.reply = lambda n: ok(PAGE, b"Connection: close\r\n")
        assert await fetcher.get(url, {}) == PAGE
        assert await fetcher.get(url, {}) == PAGE
        assert server.connections == 2  # the client honoured Connection: close
        server.reply = lambda n: ok(PAGE)
        server.close_after_each = True  # server drops idle keep-alive connections
        for _ in range(3):
            assert await fetcher.get(url, {}) == PAGE
    finally:
        await fetcher.close()


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom", "HTTP 500"),
        (b"HTTP/1.1 200 OK\r\n\r\n" + PAGE, "neither Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "too large"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "invalid HTTP"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "invalid HTTP"),
        (ok(b"\x1f\x8b", b"Content-Encoding: gzip\r\n"), "content-encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
    ],
)
async def test_bad_answers_are_scrape_errors(
    raw: tuple[RawServer, str], reply: bytes, error: str
) -> None:
    server, url = raw
    server.reply = lambda n: reply
    fetcher = LeanHttpFetcher()
    try:
        with pytest.raises(ScrapeError, match=error):
            await fetcher.get(url, {})
        server.reply = lambda n: ok(PAGE)
        assert await fetcher.get(url, {}) == PAGE  # a fresh connection after an error
    finally:
        await fetcher.close()


async def test_truncated_body_and_cancellation_drop_the_connection(
    raw: tuple[RawServer, str],
) -> None:
    server, url = raw
    server.reply = lambda n: ok(PAGE)[:-100]  # promises more than it sends, then hangs
    fetcher = LeanHttpFetcher()
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await fetcher.get(url, {})
        server.reply = lambda n: ok(PAGE)
        assert await fetcher.get(url, {}) == PAGE
        assert server.connections == 2  # the half-read connection was not reused
    finally:
        await fetcher.close()


async def test_https_with_a_self_signed_certificate(self_signed: tuple[Path, Path]) -> None:
    cert, key = self_signed
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    server = RawServer()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cafile=str(cert))
    fetcher = LeanHttpFetcher(ssl_context=client_ctx)
    try:
        assert await fetcher.get(f"https://127.0.0.1:{port}/metrics", {}) == PAGE
        # The system trust store does not know this cert: a scrape error, the node goes stale.
        with pytest.raises(ScrapeError, match="certificate verify failed"):
            await LeanHttpFetcher().get(f"https://127.0.0.1:{port}/metrics", {})
    finally:
        await fetcher.close()
        srv.close()


# ---- property: whatever a server answers, the client fails only in ways the scraper handles


EXPECTED = (ScrapeError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    reply=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda status, headers, body: (
                b"HTTP/1.1 " + status + b"\r\n" + headers + b"\r\n" + body
            ),
            st.sampled_from([b"200 OK", b"204 No Content", b"200", b"abc", b"301 Moved"]),
            st.lists(
                st.sampled_from(
                    [
                        b"Content-Length: 5\r\n",
                        b"Content-Length: -1\r\n",
                        b"Content-Length: \r\n",
                        b"Transfer-Encoding: chunked\r\n",
                        b"Connection: close\r\n",
                        b"Content-Encoding: br\r\n",
                        b"X: y\r\n",
                        b"broken header\r\n",
                    ]
                ),
                max_size=4,
            ).map(b"".join),
            st.sampled_from(
                [
                    b"",
                    b"hello",
                    b"5\r\nhello\r\n0\r\n\r\n",
                    b"-3\r\nabc\r\n",
                    b"ffffffffffff\r\n",
                    b"5\r\nhel",
                ]
            ),
        ),
    )
)
async def test_any_answer_is_bytes_or_an_expected_error(
    raw: tuple[RawServer, str], reply: bytes
) -> None:
    server, url = raw
    server.reply = lambda n: reply
    server.close_after_each = True
    fetcher = LeanHttpFetcher()
    try:
        async with asyncio.timeout(2):
            body = await fetcher.get(url, {})
        assert isinstance(body, bytes)
    except EXPECTED:
        pass
    finally:
        await fetcher.close()
