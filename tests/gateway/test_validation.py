"""Bad input gets an OpenAI-shaped 4xx before anything reaches an engine."""

from __future__ import annotations

import httpx

from gateway.helpers import openai_error
from kvgate.testing import FakeEngine

GOOD = b'{"model": "fake-model", "prompt": "p"}'


MALFORMED = [
    (b"", None, "invalid_request"),
    (b"{not json", None, "invalid_json"),
    (b'{"model": "fake-model", "prompt": "\xff\xfe"}', None, "invalid_json"),  # bad UTF-8
    (b"[1, 2]", None, "invalid_json"),
    (b'{"prompt": "p"}', "model", "invalid_request"),
    (b'{"model": 7, "prompt": "p"}', "model", "invalid_request"),
    (b'{"model": "fake-model", "stream": "yes"}', "stream", "invalid_request"),
    (b'{"model": "fake-model", "max_tokens": -1}', "max_tokens", "invalid_request"),
    (b'{"model": "fake-model", "max_tokens": 1.5}', "max_tokens", "invalid_request"),
    (b'{"model": "fake-model", "max_tokens": true}', "max_tokens", "invalid_request"),
    (b'{"model": "fake-model", "max_tokens": 2147483648}', "max_tokens", "invalid_request"),
    (b'{"model": "fake-model", "max_tokens": 0, "prompt": "p"}', "max_tokens", "invalid_request"),
    (b'{"model": "fake-model", "max_completion_tokens": -5}', "max_completion_tokens",
     "invalid_request"),
    (b'{"model": "fake-model", "messages": "hi"}', "messages", "invalid_request"),
]  # fmt: skip


async def test_malformed_requests_are_400(fake_engine: FakeEngine, gateway_factory) -> None:
    """Every case against one gateway (one server start instead of one per case)."""
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for body, param, code in MALFORMED:
            response = await client.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400, body
            error = openai_error(response.content)
            assert error["type"] == "invalid_request_error", body
            assert (error["param"], error["code"]) == (param, code), body
            assert response.headers["x-request-id"], body
    assert not fake_engine.completions()


async def test_a_missing_prompt_is_named_by_the_route(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """A body with neither `prompt` nor `messages`: the error names the one the route
    needs (`prompt` for `/v1/completions`, `messages` for chat)."""
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for route, body, field in [
            ("/v1/completions", {"model": "fake-model"}, "prompt"),
            ("/v1/chat/completions", {"model": "fake-model"}, "messages"),
        ]:
            response = await client.post(route, json=body)
            assert response.status_code == 400, (route, body)
            error = openai_error(response.content)
            assert error["param"] == field and f"`{field}` is required" in error["message"]
    assert not fake_engine.completions()


async def test_bad_priority_is_400(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post(
            "/v1/completions", content=GOOD, headers={"X-Kvgate-Priority": "urgent"}
        )
    assert response.status_code == 400
    assert openai_error(response.content)["param"] == "X-Kvgate-Priority"


async def test_body_over_the_limit_is_413(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url], overrides={"limits.max_body_bytes": 1000})
    big = b'{"model": "fake-model", "prompt": "' + b"x" * 2000 + b'"}'

    async def chunks():  # no content-length: the limit must hold while reading
        for i in range(0, len(big), 300):
            yield big[i : i + 300]

    async with httpx.AsyncClient(base_url=gw.url) as client:
        declared = await client.post("/v1/completions", content=big)
        streamed = await client.post("/v1/completions", content=chunks())
        fine = await client.post("/v1/completions", content=GOOD)
    for response in (declared, streamed):
        assert response.status_code == 413
        assert openai_error(response.content)["code"] == "request_too_large"
    assert fine.status_code == 200
    assert len(fake_engine.completions()) == 1


async def test_unknown_routes_and_methods(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        missing = await client.get("/nope")
        wrong = await client.get("/v1/completions")
        push = await client.post("/admin/signals", content=b"{}")
    assert missing.status_code == 404 and openai_error(missing.content)["code"] == "not_found"
    assert wrong.status_code == 405
    assert push.status_code == 403  # no admin token configured: pushes are refused
