"""Small clients for gateway tests: a raw HTTP/1.1 socket (to drop the connection at an
exact moment) and parsing of OpenAI error bodies."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import urlsplit

import orjson


class RawClient:
    """One HTTP/1.1 request over a plain socket, read as far as the test wants, then dropped."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.received = b""
        self.closed_at: float | None = None

    @classmethod
    async def post(
        cls, base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> RawClient:
        parts = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        data = orjson.dumps(body)
        head = f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        head += f"content-length: {len(data)}\r\n\r\n"
        writer.write(head.encode() + data)
        await writer.drain()
        return cls(reader, writer)

    async def read_until(self, marker: bytes, count: int = 1, within: float = 5.0) -> bytes:
        """Read until `marker` occurred `count` times in everything received so far."""
        async with asyncio.timeout(within):
            while self.received.count(marker) < count:
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise AssertionError(f"connection closed before {marker!r} x{count}")
                self.received += chunk
        return self.received

    async def read_all(self, within: float = 5.0) -> bytes:
        async with asyncio.timeout(within):
            while chunk := await self.reader.read(65536):
                self.received += chunk
        return self.received

    async def count_to_end(self, marker: bytes, within: float = 20.0) -> tuple[int, bytes]:
        """Read a chunked body to its end without keeping it: (count of `marker`, last bytes).

        The end is the terminating chunk (the connection stays open: keep-alive) or EOF.
        """
        count = self.received.count(marker)
        tail = self.received[-(len(marker) - 1) :] if len(marker) > 1 else b""
        async with asyncio.timeout(within):
            while not tail.endswith(b"\r\n0\r\n\r\n"):
                chunk = await self.reader.read(1 << 20)
                if not chunk:
                    break
                window = tail + chunk
                count += window.count(marker) - tail.count(marker)
                tail = window[-64:]
        return count, tail

    def drop(self) -> float:
        """Close the connection now (FIN), as a client that gave up does; returns when."""
        self.closed_at = time.monotonic()
        self.writer.close()
        return self.closed_at


def openai_error(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body, checked for its four keys."""
    data = orjson.loads(body)
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error
