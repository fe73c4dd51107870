"""A whole response leaves kvgate in one write (`kvgate.gateway.coalesce.HeadCork`).

The unit tests drive the cork over a transport that records its writes, to pin down the
order of bytes in each case. The gateway tests read a real socket: with the cork in place a
whole answer, an error and a `100 Continue` exchange must still arrive complete and in
order. (A client cannot tell one write from two sent microseconds apart, so the count of
system calls is measured by the benchmark instead: `benchmarks/proxy_overhead/results.md`.)
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import orjson
from conftest import FakeEngine

from gateway.helpers import RawClient, openai_error
from kvgate.gateway.coalesce import HeadCork

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
NATIVE = {"upstream.client": "native"}


class RecordingTransport:
    """The parts of a transport the cork uses, keeping every write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def _cork() -> tuple[HeadCork, RecordingTransport]:
    transport = RecordingTransport()
    return HeadCork(transport, asyncio.get_running_loop()), transport  # type: ignore[arg-type]


async def test_a_head_and_its_body_go_out_in_one_write() -> None:
    cork, transport = _cork()
    cork.write(HEAD)
    assert transport.writes == []
    cork.write(b"ok")
    assert transport.writes == [HEAD + b"ok"]
    await asyncio.sleep(0)  # the end-of-turn flush finds nothing left to send
    assert transport.writes == [HEAD + b"ok"]


async def test_a_head_without_a_body_goes_out_at_the_end_of_the_loop_turn() -> None:
    cork, transport = _cork()
    cork.write(HEAD)
    await asyncio.sleep(0)
    assert transport.writes == [HEAD]
    cork.write(b"5\r\nhello\r\n")  # a streamed chunk later: written through, not held
    assert transport.writes == [HEAD, b"5\r\nhello\r\n"]


async def test_an_informational_head_is_not_held() -> None:
    cork, transport = _cork()
    cork.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    cork.write(HEAD)
    cork.write(b"ok")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n", HEAD + b"ok"]


async def test_closing_sends_a_held_head_first() -> None:
    cork, transport = _cork()
    cork.write(HEAD)
    cork.close()
    assert transport.writes == [HEAD]
    assert transport.closed and cork.is_closing()
    await asyncio.sleep(0)  # the scheduled flush must not write to the closed transport
    assert transport.writes == [HEAD]


async def test_a_held_head_is_dropped_when_the_connection_is_gone() -> None:
    cork, transport = _cork()
    cork.write(HEAD)
    transport.close()  # the client left before the end of the turn
    await asyncio.sleep(0)
    assert transport.writes == []
    assert cork.get_extra_info("peername") == ("127.0.0.1", 1)


# ---- through the gateway ------------------------------------------------------------------


async def _first_read(client: RawClient) -> bytes:
    """The bytes of the client's first read of its answer (one write arrives whole)."""
    async with asyncio.timeout(5):
        return await client.reader.read(65536)


def _complete(response: bytes) -> tuple[bytes, bytes]:
    """(head, body) of a response whose body is complete by its content-length."""
    head, _, body = response.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    assert len(body) == length, (len(body), length)
    return head, body


async def test_whole_answers_arrive_complete_on_a_kept_alive_connection(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url], overrides=NATIVE)
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
    client = await RawClient.post(gw.url, "/v1/completions", body)
    try:
        for turn in range(3):  # each answer on the connection is corked on its own
            if turn:
                data = orjson.dumps(body)
                client.writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n"
                    b"content-type: application/json\r\n\r\n%b" % (len(data), data)
                )
            head, answer = _complete(await _first_read(client))
            assert head.startswith(b"HTTP/1.1 200")
            assert orjson.loads(answer)["object"] == "text_completion"
    finally:
        client.drop()


async def test_an_error_arrives_complete(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url])
    client = await RawClient.post(gw.url, "/v1/completions", {"model": "nope", "prompt": "hi"})
    try:
        head, body = _complete(await _first_read(client))
    finally:
        client.drop()
    assert head.startswith(b"HTTP/1.1 404")
    assert openai_error(body)["code"] == "model_not_found"


async def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_sent(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    parts = urlsplit(gw.url)
    body = orjson.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 4})
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        async with asyncio.timeout(5):
            interim = await reader.readuntil(b"\r\n\r\n")
        assert interim.startswith(b"HTTP/1.1 100")
        writer.write(body)
        client = RawClient(reader, writer)
        head, data = _complete(await client.read_until(b"text_completion"))
        assert head.startswith(b"HTTP/1.1 200")
        assert orjson.loads(data)["object"] == "text_completion"
    finally:
        writer.close()
