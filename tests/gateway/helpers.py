"""Small clients for gateway tests: a raw HTTP/1.1 socket (to drop the connection at an
exact moment), `kvgate serve` as a process, and parsing of OpenAI error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from kvgate.testing import free_port


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


@dataclass
class ServedGateway:
    """A `kvgate serve` process; `stderr` and `returncode` are set once it stopped."""

    url: str
    process: asyncio.subprocess.Process
    stderr: bytes = b""
    returncode: int | None = None


@contextlib.asynccontextmanager
async def kvgate_serve(
    *args: str, cwd: Path | None = None, stop_within: float = 15.0
) -> AsyncIterator[ServedGateway]:
    """`python -m kvgate serve ARGS --port P`, without the environment's KVGATE_* settings.

    SIGTERM at the end of the block, then its log (stderr) and exit code are kept; a
    process that does not stop in `stop_within` seconds, or a failed block, is killed.
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "serve", *args, "--port", str(port),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd,
    )  # fmt: skip
    served = ServedGateway(f"http://127.0.0.1:{port}", process)
    try:
        yield served
        process.send_signal(signal.SIGTERM)
        _, served.stderr = await asyncio.wait_for(process.communicate(), stop_within)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        served.returncode = process.returncode


async def until_ready(client: httpx.AsyncClient, within: float = 15.0) -> bool:
    """Poll `GET /readyz` (the client's base URL: a gateway still starting) until 200."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if (await client.get("/readyz")).status_code == 200:
                return True
        except httpx.TransportError:
            pass  # not listening yet
        await asyncio.sleep(0.05)
    return False


def access_lines(log: bytes) -> list[dict[str, Any]]:
    """The access records in a `kvgate serve` log, in either log format."""
    records = []
    for line in log.splitlines():
        if b'"logger":"kvgate.access"' in line:  # json: one object per line
            records.append(orjson.loads(line))
        elif b" INFO kvgate.access: " in line:  # text: the record is the message
            records.append(orjson.loads(line.split(b" INFO kvgate.access: ", 1)[1]))
    return records


def openai_error(body: bytes) -> dict[str, Any]:
    """The `error` object of an OpenAI-shaped error body, checked for its four keys."""
    data = orjson.loads(body)
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error
