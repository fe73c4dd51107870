"""The live load generator's client: exact token counts, honest endings, zombie accounting.

A tiny SSE server on 127.0.0.1 plays an engine whose server merges tokens into one event
(as vLLM does when it lags), so the counts the client keeps can be checked exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvgate.bench.live.client import ClientRun, StreamRead, one_attempt
from kvgate.bench.live.run import zombie_account
from kvgate.bench.metrics import ERROR, OK, TIMEOUT, Attempt


def _event(ids: list[int]) -> bytes:
    chunk = {"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


SAID: list[str | None] = []  # each request's `x-envoy-expected-rq-timeout-ms`, in order


async def _stream(request: web.Request) -> web.StreamResponse:
    """`tokens` tokens, 3 per event, `gap` s apart; `cut` ends it with an error event."""
    SAID.append(request.headers.get("x-envoy-expected-rq-timeout-ms"))
    knobs = orjson.loads(await request.read())
    tokens = int(knobs.get("tokens", 30))
    gap = float(knobs.get("gap", 0))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for start in range(0, tokens, 3):
        await resp.write(_event(list(range(start, min(tokens, start + 3)))))
        await asyncio.sleep(gap)
    if knobs.get("cut"):
        await resp.write(b'event: error\ndata: {"error": {"message": "upstream failed"}}\n\n')
        return resp
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}
    await resp.write(b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n")
    return resp


@pytest.fixture
async def sse_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _try(url: str, knobs: dict[str, float], deadline_s: float, shared: ClientRun) -> Attempt:
    body = orjson.dumps(knobs)
    async with aiohttp.ClientSession() as session:
        return await one_attempt(session, url, body, 0.0, deadline_s, shared, "r1")


async def test_a_whole_answer_counts_its_usage_not_its_events(sse_url: str) -> None:
    shared = ClientRun(time.monotonic())
    attempt = await _try(sse_url, {"tokens": 31}, 5.0, shared)
    assert attempt.outcome == OK and attempt.output_tokens == 31  # 11 events, 31 tokens
    assert (shared.delivered, shared.delivered_whole, shared.departures) == (31, 31, 0)


async def test_a_client_that_leaves_counts_the_tokens_it_read(sse_url: str) -> None:
    shared = ClientRun(time.monotonic())
    attempt = await _try(sse_url, {"tokens": 300, "gap": 0.05}, 0.5, shared)
    assert attempt.outcome == TIMEOUT
    assert shared.departures == shared.departed_midstream == 1
    assert 0 < shared.departed_events < 100
    assert shared.departed_tokens == 3 * shared.departed_events == attempt.output_tokens
    assert shared.log and shared.log[-1]["tokens_read"] == attempt.output_tokens


async def test_a_client_that_says_its_timeout_sends_it_as_a_proxy_would(sse_url: str) -> None:
    """`--clients-say-timeout`: each try carries the time it will wait for the whole answer,
    in milliseconds, as Envoy's route timeout; a client that does not say sends nothing."""
    SAID.clear()
    await _try(sse_url, {"tokens": 3}, 2.5, ClientRun(time.monotonic(), says_timeout=True))
    await _try(sse_url, {"tokens": 3}, 2.5, ClientRun(time.monotonic()))
    assert SAID == ["2500", None]


async def test_a_stream_cut_by_an_error_event_is_not_a_whole_answer(sse_url: str) -> None:
    shared = ClientRun(time.monotonic())
    attempt = await _try(sse_url, {"tokens": 12, "cut": 1}, 5.0, shared)
    assert attempt.outcome == ERROR and attempt.output_tokens == 12
    assert shared.delivered_whole == 0 and shared.log[-1]["error_event"] is True


def test_events_carrying_several_tokens_are_counted_by_their_ids() -> None:
    read = StreamRead()
    assert read.feed(_event([1, 2, 3, 4]).strip())
    assert not read.feed(b"")
    assert read.feed(b'data: {"choices": [{"text": "a"}]}')  # no ids: one token
    assert not read.feed(b"data: [DONE]")
    assert (read.chunks, read.tokens, read.done) == (2, 5, True)


def _shared(**counts: int) -> ClientRun:
    shared = ClientRun(0.0)
    for key, value in counts.items():
        setattr(shared, key, value)
    return shared


def test_zombie_bound_subtracts_what_the_relay_passed_to_clients_still_there() -> None:
    deltas = {"vllm:generation_tokens_total": 1_000.0, "vllm:request_generation_tokens_sum": 700.0}
    shared = _shared(delivered_whole=700, departures=4, departed_midstream=3,
                     departed_events=100, departed_tokens=250)  # fmt: skip
    relay = {"client_gone_streams": 3, "client_gone_events": 110, "events_after_client_gone": 0}
    a = zombie_account(deltas, shared, relay)
    assert a["undelivered"] == 50.0  # 1000 - 700 - 250
    assert a["relayed_unread_events"] == 10.0
    assert a["relayed_unread_tokens"] == 25.0  # 2.5 tokens per event, as the clients read
    assert a["zombie_bound"] == 25.0 and a["zombie_bound_per_departure"] == 6.25
    assert a["in_aborted_requests"] == 300.0


def test_without_a_relay_the_bound_is_everything_nobody_read() -> None:
    deltas = {"vllm:generation_tokens_total": 500.0, "vllm:request_generation_tokens_sum": 500.0}
    a = zombie_account(deltas, _shared(delivered_whole=480), {})
    assert a["zombie_bound"] == a["undelivered"] == 20.0
    assert a["zombie_bound_per_departure"] == 0.0  # no departures: nothing to divide by
