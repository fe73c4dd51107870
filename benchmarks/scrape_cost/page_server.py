"""A minimal keep-alive HTTP/1.1 server that answers every GET with one fixed metrics page.

Used by bench_scrape.py as the "engines": it does almost no work per request (no HTTP
framework), so that the scraper process, not the server, is what the benchmark measures.
Run: python page_server.py PAGE_FILE PORT_FILE
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


class _Conn(asyncio.Protocol):
    response = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            self.buffer = self.buffer[end + 4 :]
            self.transport.write(self.response)  # type: ignore[attr-defined]


async def main(body: bytes, port_file: str) -> None:
    _Conn.response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Conn, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    await asyncio.to_thread(Path(port_file).write_text, str(port))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(Path(sys.argv[1]).read_bytes(), sys.argv[2]))
