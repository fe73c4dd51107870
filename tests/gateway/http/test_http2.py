"""HTTP/2 through hypercorn: h2c with prior knowledge; a reset stream cancels one request."""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.events
import orjson

from kvgate.testing import FakeEngine


class H2Client:
    """A minimal prior-knowledge h2c client over asyncio streams, driven by the test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.data: dict[int, bytes] = {}
        self.status: dict[int, int] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()

    @classmethod
    async def connect(cls, url: str) -> H2Client:
        parts = urlsplit(url)
        context = None
        if parts.scheme == "https":  # h2 negotiated by ALPN; the test certificate is self-signed
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            context.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port, ssl=context)
        client = cls(reader, writer)
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        self.writer.write(self.conn.data_to_send())
        await self.writer.drain()

    async def post(self, path: str, body: dict, request_id: str) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        data = orjson.dumps(body)
        self.conn.send_headers(
            stream_id,
            [(":method", "POST"), (":path", path), (":scheme", "http"),
             (":authority", "gateway"), ("content-type", "application/json"),
             ("content-length", str(len(data))), ("x-request-id", request_id)],
        )  # fmt: skip
        self.conn.send_data(stream_id, data, end_stream=True)
        self.data[stream_id] = b""
        await self.flush()
        return stream_id

    async def pump(self, until, within: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        """Read frames until `until()` is true."""
        async with asyncio.timeout(within):
            while not until():
                chunk = await self.reader.read(65536)
                if not chunk:
                    raise AssertionError("the server closed the connection")
                for event in self.conn.receive_data(chunk):
                    if isinstance(event, h2.events.ResponseReceived):
                        self.status[event.stream_id] = int(dict(event.headers)[":status"])
                    elif isinstance(event, h2.events.DataReceived):
                        self.data[event.stream_id] += event.data
                        self.conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.StreamEnded):
                        self.ended.add(event.stream_id)
                    elif isinstance(event, h2.events.StreamReset):
                        self.reset.add(event.stream_id)
                await self.flush()

    async def cancel(self, stream_id: int) -> float:
        self.conn.reset_stream(stream_id, error_code=8)  # CANCEL
        await self.flush()
        return time.monotonic()

    def close(self) -> None:
        self.writer.close()


async def test_h2c_reset_cancels_only_that_stream(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url], server="hypercorn")
    client = await H2Client.connect(gw.url)
    try:
        body = {"model": "fake-model", "prompt": "p", "stream": True,
                "fake": {"chunks": 25, "interval": 0.02}}  # fmt: skip
        doomed = await client.post("/v1/completions", body, "h2-doomed")
        kept = await client.post("/v1/completions", body, "h2-kept")
        await client.pump(
            lambda: (
                client.data[doomed].count(b"data:") >= 3 and client.data[kept].count(b"data:") >= 3
            )
        )
        assert client.status == {doomed: 200, kept: 200}
        reset_at = await client.cancel(doomed)
        seen = await fake_engine.wait_closed("h2-doomed", within=3.0)
        took_ms = (seen.closed_by_client_at - reset_at) * 1e3
        print(f"\nh2 reset: engine saw the close {took_ms:.2f} ms after RST_STREAM")
        await client.pump(lambda: kept in client.ended, within=10.0)
    finally:
        client.close()
    assert client.data[kept].endswith(b"data: [DONE]\n\n")
    assert client.data[kept].count(b"data:") == 27
    survivor = fake_engine.by_id("h2-kept")
    assert survivor.closed_by_client_at is None and survivor.completed_at is not None
    assert fake_engine.by_id("h2-doomed").chunks_sent < 25


async def test_h2c_non_streaming_and_http1_share_the_port(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    import httpx

    gw = await gateway_factory([fake_engine.url], server="hypercorn")
    client = await H2Client.connect(gw.url)
    try:
        sid = await client.post("/v1/completions", {"model": "fake-model", "prompt": "p"}, "h2-1")
        await client.pump(lambda: sid in client.ended)
    finally:
        client.close()
    assert client.status[sid] == 200
    assert orjson.loads(client.data[sid])["usage"]["completion_tokens"] == 5
    async with httpx.AsyncClient(base_url=gw.url) as http1:
        response = await http1.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
    assert response.status_code == 200 and response.http_version == "HTTP/1.1"


async def test_tls_negotiates_h2_by_alpn(
    fake_engine: FakeEngine, gateway_factory, self_signed
) -> None:  # type: ignore[no-untyped-def]
    cert, key = self_signed
    gw = await gateway_factory(
        [fake_engine.url],
        server="hypercorn",
        overrides={"server.certfile": str(cert), "server.keyfile": str(key)},
    )
    assert gw.url.startswith("https://")
    client = await H2Client.connect(gw.url)
    try:
        negotiated = client.writer.get_extra_info("ssl_object").selected_alpn_protocol()
        body = {"model": "fake-model", "prompt": "p", "stream": True, "fake": {"chunks": 3}}
        sid = await client.post("/v1/completions", body, "tls-1")
        await client.pump(lambda: sid in client.ended)
    finally:
        client.close()
    assert negotiated == "h2"
    assert client.status[sid] == 200 and client.data[sid].endswith(b"data: [DONE]\n\n")
