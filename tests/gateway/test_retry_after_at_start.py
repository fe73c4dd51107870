"""A gateway hit by a burst the moment it starts answers Retry-After from what it runs.

A freshly started gateway has measured nothing yet: no request has ended, no stream has
shown the engine's pace, so no rate of freeing is known. A burst larger than the engine's
room must still be told when to come back from the gateway's own state (when the requests
it started will end), never the clamp (`MAX_RETRY_AFTER_S`, 30 s) that a gateway
without a prediction would fall back to. Real adaptive policy, the fake engine, real
sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx

from gateway.helpers import openai_error, until_ready
from kvgate.core.retry_after import MAX_RETRY_AFTER_S
from kvgate.testing import eventually

# The fake engine holds 16,384 KV tokens, 10% of them used by others: under the 0.92 panic
# watermark there is room for 4 requests of 3,000 prompt + 200 output tokens (+ 16 of
# rounding). Each streams 200 tokens 10 ms apart, so the first room frees after ~2 s.
BASE_USAGE = 0.1
PROMPT = list(range(100, 3100))  # token ids: counted exactly
OUTPUT_TOKENS = 200
ROOM = 4
BURST = 12
PATIENT = 4
NO_WAIT = {"X-Kvgate-Max-Wait-Ms": "0"}
BODY = {
    "model": "fake-model",
    "prompt": PROMPT,
    "max_tokens": OUTPUT_TOKENS,
    "stream": True,
    "fake": {"chunks": OUTPUT_TOKENS, "interval": 0.01},
}


async def _send(client: httpx.AsyncClient, headers: dict[str, str]) -> tuple[httpx.Response, float]:
    """One streamed request read to its end; (response, seconds it took)."""
    started = asyncio.get_running_loop().time()
    async with client.stream("POST", "/v1/completions", json=BODY, headers=headers) as response:
        await response.aread()
    return response, asyncio.get_running_loop().time() - started


async def test_a_burst_at_start_is_told_when_the_running_work_ends(
    engine_factory: Any, gateway_factory: Any
) -> None:
    # The engine's KV gauge shows the requests it runs, as a real engine's does.
    engine = await engine_factory(kv_usage=BASE_USAGE, kv_from_requests=True)
    gw = await gateway_factory([engine.url], policy="adaptive")
    counts = gw.gateway.admission.counts
    limits = httpx.Limits(max_connections=BURST + PATIENT)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30, limits=limits) as client:
        assert await until_ready(client), "the gateway never had a fresh sample of the engine"
        state = (await client.get("/admin/state")).json()
        # Fresh: nothing has run, so neither a pace nor a rate of freeing is known.
        policy = state["policy"]
        assert policy["released_tokens_per_s"] == 0
        assert [n["step_s"] for n in policy["nodes"].values()] == [None]
        # A burst of clients that will not wait ...
        burst = [asyncio.create_task(_send(client, NO_WAIT)) for _ in range(BURST)]
        assert await eventually(lambda: _refused(counts) >= BURST - ROOM, 10.0), counts
        await asyncio.sleep(0.05)  # (a sample between two arrivals may refuse one more)
        # ... then clients that will, while the started requests run (a sample may show
        # their prompts in the engine's gauge already: that is no reason to refuse).
        assert await eventually(lambda: all(r.chunks_sent >= 1 for r in engine.completions()), 5.0)
        patient = [asyncio.create_task(_send(client, {})) for _ in range(PATIENT)]
        answered = await asyncio.gather(*burst)
        waited = await asyncio.gather(*patient)
    started = [(r, took) for r, took in answered if r.status_code == 200]
    refused = [r for r, _ in answered if r.status_code != 200]
    # The room took 4 of the burst at once (3 when a sample came between two arrivals and
    # showed the first ones' prompts while kvgate still counted them whole: the safe
    # error); the rest were refused at once, never a 5xx.
    assert ROOM - 1 <= len(started) <= ROOM, [r.status_code for r, _ in answered]
    assert [r.status_code for r in refused] == [429] * (BURST - len(started))
    # Those willing to wait waited in the gateway and were all served.
    assert [r.status_code for r, _ in waited] == [200] * PATIENT, [r.text for r, _ in waited]
    assert counts["queued"] == counts["admitted_after_wait"] == PATIENT
    assert all(b"[DONE]" in r.content for r, _ in started + waited)
    # Every refusal: an OpenAI error, a reason, and a Retry-After from the running work.
    ends_after = max(took for _, took in started)  # when the room really freed
    clamp = MAX_RETRY_AFTER_S
    for response in refused:
        error = openai_error(response.content)
        assert error["type"] == "rate_limit_error", error
        assert response.headers["x-kvgate-reason"], response.headers
        told_s = int(response.headers["retry-after-ms"]) / 1000
        assert int(response.headers["retry-after"]) >= 1
        # At most twice the time the started work actually took (2 s of streaming): a
        # prediction from what runs, nowhere near the clamp.
        assert told_s <= 2 * ends_after < clamp, (told_s, ends_after)


def _refused(counts: Mapping[str, int]) -> int:
    return sum(n for event, n in counts.items() if event.startswith("refused:"))
