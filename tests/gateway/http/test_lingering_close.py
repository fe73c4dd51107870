"""The 413 always arrives: a client that writes its whole oversized body before it reads
gets the answer, not a reset (the lingering close in kvgate.gateway.http.guard)."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import orjson
import pytest

BIG = 50 * 1024 * 1024
STEP = 1024 * 1024
ROUNDS = 20


async def _send_all_then_read(url: str, *, chunked: bool, close: bool) -> bytes:
    """One POST of a 50 MB body written at full speed, then the whole answer read."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.setblocking(False)
    try:
        head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        head += "connection: close\r\n" if close else ""
        head += "transfer-encoding: chunked\r\n" if chunked else f"content-length: {BIG}\r\n"
        await loop.sock_sendall(sock, head.encode() + b"\r\n")
        piece = b"x" * STEP
        for _ in range(BIG // STEP):
            await loop.sock_sendall(sock, b"%x\r\n%b\r\n" % (STEP, piece) if chunked else piece)
        if chunked:
            await loop.sock_sendall(sock, b"0\r\n\r\n")
        answer = b""
        async with asyncio.timeout(10):
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}}"):
                data = await loop.sock_recv(sock, 65536)
                if not data:
                    break
                answer += data
        return answer
    finally:
        sock.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_50_mb_body_gets_its_413_every_time(
    fake_engine, gateway_factory, chunked: bool
) -> None:
    gw = await gateway_factory([fake_engine.url])
    for i in range(ROUNDS):
        answer = await _send_all_then_read(gw.url, chunked=chunked, close=True)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), (i, answer[:200])
        assert orjson.loads(body)["error"]["code"] == "request_too_large"
    assert fake_engine.completions() == []


async def test_a_kept_alive_connection_is_reused_after_its_413(
    fake_engine, gateway_factory
) -> None:
    """Without `connection: close` the rest of the body is parsed away and the connection
    serves the next request."""
    gw = await gateway_factory([fake_engine.url], overrides={"limits.max_body_bytes": 1000})
    parts = urlsplit(gw.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        big = b"x" * (4 * STEP)
        good = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 3}'
        for body in (big, good):
            head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
            writer.write(head.encode() + b"content-type: application/json\r\n\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(10):
            first = await reader.readuntil(b"\r\n\r\n")
            assert first.startswith(b"HTTP/1.1 413")
            length = int(first.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            second = await reader.readuntil(b"\r\n\r\n")
        assert second.startswith(b"HTTP/1.1 200"), second
    finally:
        writer.close()
