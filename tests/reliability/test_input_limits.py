"""Bad and hostile input on a real uvicorn: always an OpenAI-shaped 4xx/503, never a 500."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from gateway.helpers import openai_error

from kvgate.gateway.http.guard import MAX_HEADER_BYTES, ConnectionLimits
from kvgate.testing import FakeEngine

GOOD = b'{"model": "fake-model", "prompt": "p", "max_tokens": 3}'


async def _raw(url: str, payload: bytes, *, within: float = 5.0) -> bytes:
    host, _, port = url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(within):
            return await reader.read()
    finally:
        writer.close()


def _split(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "fake-model", "max_tokens": 1e999}', None),  # absurd: not valid JSON
        (b'{"model": "fake-model", "max_tokens": "10"}', "max_tokens"),
        (b'{"model": "fake-model", "max_tokens": 1e9}', "max_tokens"),  # float, absurd
        (b'{"model": "fake-model", "max_tokens": 100000000000000000000000}', None),
        (b'{"model": "", "prompt": "p"}', "model"),
        (b'{"model": ["fake-model"]}', "model"),
        (b'{"model": "fake-model", "stream": 1}', "stream"),
        (b"\xef\xbb\xbf{}", None),  # BOM, then an object without model
        (b'{"model": "fake-model", "prompt": "\xed\xa0\x80"}', None),  # UTF-8 surrogate
        (b"null", None),
        (b'"just a string"', None),
        (b"{" * 5000, None),  # deep nesting
    ],
)
async def test_more_malformed_bodies_are_400(
    fake_engine: FakeEngine, gateway_factory, body: bytes, param: str | None
) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post("/v1/completions", content=body)
    assert response.status_code == 400, response.text
    error = openai_error(response.content)
    if param is not None:
        assert error["param"] == param
    assert not fake_engine.completions()


async def test_huge_headers_get_431_and_the_gateway_goes_on(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    assert MAX_HEADER_BYTES < 40_000
    one_big = b"x-big: " + b"a" * 40_000 + b"\r\n"
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 60) for i in range(600))
    for extra in (one_big, many):
        raw = await _raw(
            gw.url,
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(GOOD) + GOOD,
        )  # fmt: skip
        status, headers, body = _split(raw)
        assert status == 431 and headers["connection"] == "close"
        assert openai_error(body)["code"] == "headers_too_large"
    long_url = b"GET /v1/models?" + b"q" * 40_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    assert _split(await _raw(gw.url, long_url))[0] == 431
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", content=GOOD)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'kvgate_connections_refused_total{status="431"} 3.0' in metrics
    assert len(fake_engine.completions()) == 1


async def test_slow_clients_get_408(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory(
        [fake_engine.url], connection_limits=ConnectionLimits(client_timeout_s=0.3)
    )
    host, _, port = gw.url.removeprefix("http://").rpartition(":")

    async def trickle(first: bytes) -> tuple[bytes, float]:
        """Send `first`, then one byte every 0.1 s for at most 3 s; return the answer."""
        reader, writer = await asyncio.open_connection(host, int(port))
        loop = asyncio.get_running_loop()
        started = loop.time()
        writer.write(first)
        try:
            async with asyncio.timeout(3):
                read = asyncio.create_task(reader.read())
                while not read.done():
                    with __import__("contextlib").suppress(ConnectionError):
                        writer.write(b"x")
                    await asyncio.wait({read}, timeout=0.1)
                return read.result(), loop.time() - started
        finally:
            writer.close()

    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n" % len(GOOD)
    slow_head, took_head = await trickle(head[:20])
    slow_body, took_body = await trickle(head + b"\r\n" + GOOD[:10])
    for raw, took in ((slow_head, took_head), (slow_body, took_body)):
        status, _, body = _split(raw)
        assert status == 408 and openai_error(body)["code"] == "request_timeout"
        assert took < 1.5
    # A connection that sends nothing at all is closed as well.
    silent, took = await _raw(gw.url, b""), 0
    assert silent.startswith(b"HTTP/1.1 408") or silent == b""
    assert not fake_engine.completions()
    # A long streamed answer is not cut by the read deadline (it ends when the body is read).
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 6, "interval": 0.1}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200 and response.content.endswith(b"data: [DONE]\n\n")


async def test_connection_cap_answers_503(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory(
        [fake_engine.url], connection_limits=ConnectionLimits(max_connections=3)
    )
    host, _, port = gw.url.removeprefix("http://").rpartition(":")
    held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        async with asyncio.timeout(5):
            raw = await reader.read()
        writer.close()
        status, headers, body = _split(raw)
        assert status == 503 and headers["retry-after"] == "1"
        assert openai_error(body)["code"] == "too_many_connections"
    finally:
        for _, w in held:
            w.close()
    await asyncio.sleep(0.1)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", content=GOOD)).status_code == 200


async def test_garbage_on_the_wire_is_400_not_a_crash(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    for junk in (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40 + b"\r\n\r\n",
                 b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\n"
                 b"content-length: -5\r\n\r\n"):  # fmt: skip
        raw = await _raw(gw.url, junk)
        status, _, body = _split(raw)
        assert status == 400
        assert orjson.loads(body)["error"]["code"] == "invalid_http"
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", content=GOOD)).status_code == 200


async def test_hypercorn_refuses_huge_headers_too(fake_engine: FakeEngine, gateway_factory):
    gw = await gateway_factory([fake_engine.url], server="hypercorn")
    raw = await _raw(
        gw.url,
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: "
        + b"a" * 200_000
        + b"\r\ncontent-length: %d\r\n\r\n" % len(GOOD)
        + GOOD,
    )
    # h11 (hypercorn) checks its limit only while a head is incomplete, so a head that
    # arrives in one read (up to 64 KiB) passes; beyond that it answers 431 itself.
    assert _split(raw)[0] == 431
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", content=GOOD)).status_code == 200
