"""A tenant's budgets through the gateway, read by the `openai` SDK as its users would: OpenAI's
`x-ratelimit-*` headers on every answer (200s, streams, refusals), a 429 `tenant_budget`
whose retry delay, as the SDK computes it from the headers, is the refill time (a day's
budget: hours, which the SDK does not wait), a 400 for a request larger than a whole
window, and a stream cut short settled by what was relayed.

The fake engine counts every prompt as 7 tokens and every answer as `chunks` tokens in its
`usage`; prompts are token ids, so kvgate's own count is exact."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import openai
import pytest

from kvgate.gateway.relay.ratelimit import duration
from kvgate.testing import FakeEngine, eventually

KEY = "acme-key-0123456789abcdef0"
HEADERS = {"x-api-key": KEY}
PROMPT = list(range(100, 150))  # 50 token ids
GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?$|^(\d+)ms$")


def seconds(text: str) -> float:
    """A reset as OpenAI writes it (`6m0s`, `1.5s`, `20ms`), in seconds."""
    match = GO_DURATION.match(text)
    assert match and text, f"not a duration as OpenAI writes one: {text!r}"
    hours, minutes, secs, ms = match.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0)


async def gateway(factory: Any, engine: FakeEngine, **budget: int) -> Any:
    overrides = {"auth.keys": [{"key": KEY, "tenant": "acme"}], "auth.tenants": {"acme": budget}}
    return await factory([engine.url], overrides=overrides)


def sdk(gw: Any, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=retries)


def spent(gw: Any) -> float:
    windows = gw.gateway.admission.snapshot()["budgets"]["acme"]["windows"]
    return float(windows["tokens_per_minute"]["spent"])


def test_resets_are_written_as_openai_writes_them() -> None:
    assert [duration(s) for s in (0, 0.02, 0.9994, 1, 1.5, 59.998, 360, 3723.5)] == [
        "0s", "20ms", "999ms", "1s", "1.5s", "59.998s", "6m0s", "1h2m3.5s",
    ]  # fmt: skip
    assert [seconds(duration(s)) for s in (0.02, 1.5, 360, 3723.5)] == [0.02, 1.5, 360, 3723.5]


async def test_every_answer_tells_the_budget_in_openais_headers(
    fake_engine: FakeEngine, gateway_factory: Any
) -> None:
    gw = await gateway(gateway_factory, fake_engine, tokens_per_minute=6000, requests_per_minute=10)
    async with sdk(gw) as client:
        raw = await client.completions.with_raw_response.create(
            model="fake-model", prompt=PROMPT, max_tokens=50
        )
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.total_tokens == 12
        first = raw.headers
        async with client.completions.with_streaming_response.create(
            model="fake-model", prompt=PROMPT, max_tokens=50, stream=True
        ) as stream:
            streamed = stream.headers
            async for _ in stream.iter_lines():
                pass
    # While the first ran it held its most: 50 prompt + 50 output of the 6,000 a minute,
    # given back at 100 a second by the refill; it would be full again in (6,000 - left) s.
    assert first["x-ratelimit-limit-tokens"] == "6000"
    left = int(first["x-ratelimit-remaining-tokens"])
    assert 5900 <= left < 6000
    assert seconds(first["x-ratelimit-reset-tokens"]) == pytest.approx((6000 - left) / 100, 0.02)
    assert first["x-ratelimit-limit-requests"] == "10"
    assert first["x-ratelimit-remaining-requests"] == "9"
    assert 5.0 <= seconds(first["x-ratelimit-reset-requests"]) <= 6.0  # one every 6 s
    # The stream's answer tells them too, with its own request held and the first one's
    # 12 tokens used (given back by the refill since).
    assert streamed["x-ratelimit-limit-tokens"] == "6000"
    assert 5888 <= int(streamed["x-ratelimit-remaining-tokens"]) < 6000
    assert int(streamed["x-ratelimit-remaining-requests"]) in (8, 9)
    assert spent(gw) == 24  # each settled with the engine's count: 7 + 5


async def test_a_refusal_tells_the_refill_time_and_the_sdk_waits_for_it(
    fake_engine: FakeEngine, gateway_factory: Any
) -> None:
    gw = await gateway(gateway_factory, fake_engine, tokens_per_minute=6000)
    async with sdk(gw) as client:
        # 5,950 of the 6,000 used at once (the engine counts 7 + 5,943 tokens).
        body = {"fake": {"chunks": 5943}}
        await client.completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=5943, extra_body=body
        )
        assert 5949 <= spent(gw) <= 5950
        # 150 more need 1 s of refill; told not to wait, the request is refused.
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(
                model="fake-model",
                prompt=PROMPT,
                max_tokens=100,
                extra_headers={"X-Kvgate-Max-Wait-Ms": "0"},
            )
    error = refused.value
    assert error.status_code == 429 and error.code == "tenant_budget"
    headers = error.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "6000"
    left = int(headers["x-ratelimit-remaining-tokens"])
    assert 50 <= left < 150
    assert seconds(headers["x-ratelimit-reset-tokens"]) == pytest.approx((6000 - left) / 100, 0.02)
    # What the SDK will wait (it reads `retry-after-ms`): the refill of the 150 it needs.
    wait = client._calculate_retry_timeout(0, _options(), headers)
    assert (150 - left - 1) / 100 <= wait <= (150 - left + 1) / 100 * 1.05
    # With one retry the SDK sleeps the Retry-After, and the refill is there.
    async with sdk(gw, retries=1) as patient:
        started = asyncio.get_running_loop().time()
        done = await patient.completions.create(
            model="fake-model",
            prompt=PROMPT,
            max_tokens=100,
            extra_headers={"X-Kvgate-Max-Wait-Ms": "0"},
        )
        took = asyncio.get_running_loop().time() - started
    assert done.usage is not None and 0.9 <= took <= 2.0


async def test_a_days_budget_tells_hours_and_the_sdk_does_not_retry_that_long(
    fake_engine: FakeEngine, gateway_factory: Any
) -> None:
    gw = await gateway(gateway_factory, fake_engine, tokens_per_day=1000)
    async with sdk(gw, retries=2) as client:
        body = {"fake": {"chunks": 893}}
        await client.completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=893, extra_body=body
        )  # 900 of the 1,000 used: 7 + 893 as the engine counts them
        started = asyncio.get_running_loop().time()
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(
                model="fake-model",
                prompt=PROMPT,
                max_tokens=100,
                extra_headers={"X-Kvgate-Max-Wait-Ms": "0"},
            )
        took = asyncio.get_running_loop().time() - started
    headers = refused.value.response.headers
    # 150 needed (50 prompt ids, 100 output), 100 left: 50 tokens of a refill of 1,000 a
    # day, 1.2 hours.
    wait = client._calculate_retry_timeout(0, _options(), headers)
    assert 1.19 * 3600 <= float(headers["retry-after"]) <= 1.27 * 3600
    assert re.match(r"^2[0-9]h[0-9]+m[0-9.]+s$", headers["x-ratelimit-reset-tokens"])
    assert seconds(headers["x-ratelimit-reset-tokens"]) > 20 * 3600  # full again in a day
    # The SDK honours a Retry-After of two minutes at most: this one it does not retry
    # (its own backoff would be a few seconds), it raises at once.
    assert not client._should_retry(refused.value.response)
    assert wait <= 60 and took < 5.0


async def test_a_request_larger_than_a_whole_window_is_a_400(
    fake_engine: FakeEngine, gateway_factory: Any
) -> None:
    gw = await gateway(gateway_factory, fake_engine, tokens_per_minute=600)
    async with sdk(gw) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=600)
    assert refused.value.code == "tenant_budget"
    assert "can never start" in str(refused.value)
    assert refused.value.response.headers["x-ratelimit-limit-tokens"] == "600"


async def test_a_stream_cut_short_is_settled_by_what_the_engine_produced(
    fake_engine: FakeEngine, gateway_factory: Any
) -> None:
    gw = await gateway(gateway_factory, fake_engine, tokens_per_minute=60_000)
    body = {
        "model": "fake-model",
        "prompt": PROMPT,
        "max_tokens": 400,
        "stream": True,
        "fake": {"chunks": 400, "interval": 0.01},
    }
    got = 0
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body, headers=HEADERS) as response,
    ):
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-tokens"] == "60000"
        async for line in response.aiter_lines():
            got += line.startswith("data: ")
            if got == 30:
                break  # the client leaves
    assert await eventually(lambda: gw.gateway.admission.snapshot()["in_flight_requests"] == 0)
    (seen,) = fake_engine.completions()
    produced = len(seen.chunk_times)
    assert produced < 400  # the engine was told to stop
    # Settled by its prompt (50, counted exactly) and the tokens relayed: at least what the
    # client read, at most what the engine sent; the rest of the 450 reserved came back.
    assert 50 + got <= spent(gw) <= 50 + produced


def _options() -> Any:
    from openai._models import FinalRequestOptions

    return FinalRequestOptions(method="post", url="/completions")
