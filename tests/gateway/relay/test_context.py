"""A request longer than the engines' context is refused at once, in vLLM's words as
kvgate's own 400 (`context_length_exceeded`), and never sent; one that only the estimator's
safety margin would push over is sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer

LIMIT = CPU_TINY.max_model_len  # 2048, listed by the simulator's /v1/models as vLLM does
MODEL = "sim-llama"


def _relayed(gw: object) -> int:
    """Requests the gateway sent to a backend (`backend` is "-" for what it answered)."""
    requests = gw.gateway.metrics.requests  # type: ignore[attr-defined]
    return sum(n for (_, _, backend), n in requests.items() if backend != "-")


async def test_over_the_context_is_kvgates_400_in_the_engines_words_without_sending(
    sim_server: SimServer, gateway_factory
) -> None:
    gw = await gateway_factory([f"http://127.0.0.1:{sim_server.port}"])
    await gw.gateway.catalog.refresh()
    assert gw.gateway.catalog.max_model_len(MODEL) == LIMIT
    async with httpx.AsyncClient(base_url=gw.url) as client:
        ids = list(range(10, 3010))  # exactly 3,000 tokens
        long_ids = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 10}
        )
        output = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 3000},
        )  # fmt: skip
        # 8,800 characters: 2,200 tokens for the simulator, which counts it (`/tokenize`).
        long_text = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "abcd" * 2200, "max_tokens": 10},
        )
        relayed_before = _relayed(gw)
        # A batch: each prompt alone fits, as vLLM checks them, so it is sent (the simulator
        # then answers that it serves one prompt per request).
        batch = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ["abcd" * 400] * 3, "max_tokens": 4},
        )
    assert long_ids.status_code == 400
    assert long_ids.json() == {
        "error": {
            # vLLM 0.32's words for the same request (read from the real engine).
            "message": "This model's maximum context length is 2048 tokens. However, your"
            " prompt contains 3000 input tokens, which exceeds this limit even without any"
            " output tokens. Please reduce the length of the input prompt."
            " (parameter=input_tokens, value=3000)",
            "type": "invalid_request_error",
            "param": "input_tokens",
            "code": "context_length_exceeded",
        }
    }
    assert long_ids.headers["x-kvgate-reason"] == "context_length_exceeded"
    assert "retry-after" not in long_ids.headers
    assert output.status_code == 400
    assert output.json()["error"]["message"] == (
        "max_tokens=3000 cannot be greater than max_model_len=2048. Please request fewer"
        " output tokens. (parameter=max_tokens, value=3000)"
    )
    assert long_text.status_code == 400
    assert "contains 2200 input tokens" in long_text.json()["error"]["message"]
    assert relayed_before == 0, "a request refused for its length reached an engine"
    assert "x-kvgate-reason" not in batch.headers and _relayed(gw) == 1


async def test_an_estimated_prompt_is_refused_in_about_words(
    engine_factory: Callable[..., Any], gateway_factory
) -> None:
    """An engine without `/tokenize` (a 404): 8,800 characters are 2,200 tokens at the
    typical 4 characters a token, margin or not, and the refusal says it is an estimate."""
    engine = await engine_factory(model=MODEL, max_model_len=LIMIT)
    gw = await gateway_factory([engine.url])
    await gw.gateway.catalog.refresh()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        long_text = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "abcd" * 2200, "max_tokens": 10},
        )
    assert long_text.status_code == 400
    assert "contains about 2200 input tokens" in long_text.json()["error"]["message"]
    assert _relayed(gw) == 0 and not engine.completions()


async def test_only_the_unscaled_estimate_counts(
    sim_server: SimServer, engine_factory: Callable[..., Any], gateway_factory
) -> None:
    """1,950 tokens by the estimator's ratio, 2,145 with its 1.1 safety factor: the margin
    must not refuse a prompt the engine takes (the simulator counts 4 characters a token).
    Estimated (an engine without `/tokenize`) it is sent; counted by the simulator's
    `/tokenize` it is exact, and served."""
    body = {"model": MODEL, "prompt": "abcd" * 1950, "max_tokens": 50}
    estimating = await engine_factory(model=MODEL, max_model_len=LIMIT)
    gw = await gateway_factory([estimating.url])
    await gw.gateway.catalog.refresh()
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert _relayed(gw) == 1 and len(estimating.completions()) == 1
    counting = await gateway_factory([f"http://127.0.0.1:{sim_server.port}"])
    async with httpx.AsyncClient(base_url=counting.url, timeout=30) as client:
        response = await client.post("/v1/completions", json=body)
    # vLLM serves a prompt that fits and cuts the output at the limit; so does the sim.
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 1950
    assert _relayed(counting) == 1


async def test_no_limit_is_assumed_when_a_backend_does_not_list_one(
    sim_server: SimServer, engine_factory: Callable[..., Any], gateway_factory
) -> None:
    """A fake engine lists the simulator's model without `max_model_len`: its limit is
    unknown, so the gateway checks nothing and the engines decide."""
    fake = await engine_factory(model=MODEL)
    gw = await gateway_factory([f"http://127.0.0.1:{sim_server.port}", fake.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await gw.gateway.catalog.refresh()
        assert gw.gateway.catalog.max_model_len(MODEL) is None
        response = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": list(range(3000)), "max_tokens": 10},
        )
    assert response.headers.get("x-kvgate-reason") != "context_length_exceeded"
    assert _relayed(gw) == 1


async def test_a_long_prompt_without_max_tokens_is_served_as_the_engine_serves_it(
    sim_server: SimServer, gateway_factory
) -> None:
    """The simulator refuses a prompt plus `max_tokens` over its context, as strict engines
    do, and without `max_tokens` generates up to the rest of it, as vLLM's chat does: 1,629 prompt
    tokens and no `max_tokens` are served with or without kvgate in front (kvgate once
    sent its own `max_tokens` 1,024 and got a 400 naming it)."""
    gw = await gateway_factory([f"http://127.0.0.1:{sim_server.port}"])
    await gw.gateway.catalog.refresh()
    body = {"model": MODEL, "prompt": list(range(10, 1639))}
    async with httpx.AsyncClient(timeout=60) as client:
        direct = await client.post(f"http://127.0.0.1:{sim_server.port}/v1/completions", json=body)
        relayed = await client.post(gw.url + "/v1/completions", json=body)
        chat = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "abcd" * 1600}]},
        )
    assert direct.status_code == relayed.status_code == chat.status_code == 200, relayed.text
    assert relayed.json()["usage"]["prompt_tokens"] == 1629
    assert 0 < relayed.json()["usage"]["completion_tokens"] <= LIMIT - 1629
    assert "x-kvgate-reason" not in relayed.headers
