"""The relay itself: bytes, headers, request ids, models, pass-through, access log."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from gateway.helpers import RawClient
from gateway.test_admission import RecordingPolicy
from kvgate.core.policies.baselines import BaselineOptions
from kvgate.core.settings import AdmissionSettings
from kvgate.testing import FakeEngine


async def _raw_stream(url: str, path: str, body: dict, headers: dict | None = None) -> bytes:
    async with httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", path, json=body, headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            return b"".join([chunk async for chunk in response.aiter_raw()])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_is_relayed_byte_for_byte(
    fake_engine: FakeEngine, gateway_factory, path: str
) -> None:
    gw = await gateway_factory([fake_engine.url])
    body = {"model": "fake-model", "prompt": "hi", "stream": True, "fake": {"chunks": 20}}
    direct = await _raw_stream(fake_engine.url, path, body)
    relayed = await _raw_stream(gw.url, path, body)
    assert relayed == direct
    assert relayed.count(b"data: ") == 22  # 20 tokens, the usage event, [DONE]


async def test_non_streaming_body_and_status_are_relayed(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "fake": {"chunks": 3}}
    async with httpx.AsyncClient() as client:
        direct = await client.post(fake_engine.url + "/v1/completions", json=body)
        relayed = await client.post(gw.url + "/v1/completions", json=body)
        failing = await client.post(
            gw.url + "/v1/completions", json={**body, "fake": {"status": 500}}
        )
    assert relayed.status_code == 200
    assert relayed.content == direct.content
    assert failing.status_code == 500  # the engine's own error, relayed as it was
    assert failing.json()["error"]["message"] == "fake failure"


async def test_request_id_is_kept_or_made_and_sent_both_ways(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    body = {"model": "fake-model", "prompt": "hi"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        mine = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
        made = await client.post("/v1/completions", json=body)
    assert mine.headers["x-request-id"] == "abc-1"
    assert fake_engine.by_id("abc-1").headers["x-request-id"] == "abc-1"
    new_id = made.headers["x-request-id"]
    assert len(new_id) >= 16 and new_id != "abc-1"
    assert fake_engine.by_id(new_id).path == "/v1/completions"


async def test_hop_by_hop_and_kvgate_headers_stay_here(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    headers = {
        "X-Request-Id": "hop-1",
        "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "Basic eA==",
        "TE": "trailers",
        "X-Kvgate-Priority": "critical",
        "X-Custom": "kept",
        "Authorization": "Bearer client-key",
    }
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "x"}, headers=headers
        )
    assert response.status_code == 200
    seen = fake_engine.by_id("hop-1").headers
    for name in ("keep-alive", "proxy-authorization", "te", "x-kvgate-priority"):
        assert name not in seen, name
    assert seen["x-custom"] == "kept"
    assert seen["authorization"] == "Bearer client-key"  # no engine key configured: relayed
    assert (
        "transfer-encoding" not in response.headers
        or response.headers["transfer-encoding"] != "chunked, chunked"
    )


async def test_models_are_the_union_and_requests_go_where_the_model_is(
    engine_factory, gateway_factory
) -> None:
    a = await engine_factory(model="alpha")
    b = await engine_factory(model="beta", models=["shared"])
    gw = await gateway_factory([a.url, b.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        models = await client.get("/v1/models")
        for i in range(4):
            r = await client.post(
                "/v1/completions",
                json={"model": "beta", "prompt": "p"},
                headers={"X-Request-Id": f"beta-{i}"},
            )
            assert r.status_code == 200
        unknown = await client.post("/v1/completions", json={"model": "gamma", "prompt": "p"})
    assert models.status_code == 200
    assert sorted(m["id"] for m in models.json()["data"]) == ["alpha", "beta", "shared"]
    assert len([r for r in b.completions() if r.request_id.startswith("beta-")]) == 4
    assert not [r for r in a.completions() if (r.request_id or "").startswith("beta-")]
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"


async def test_other_v1_paths_pass_through_unchanged(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    gw = await gateway_factory([fake_engine.url])
    payload = {"model": "fake-model", "input": "héllo"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post("/v1/embeddings?x=1", content=orjson.dumps(payload))
        head = await client.head("/v1/embeddings")  # no body, yet content-length: no hang
        after = await client.get("/v1/files")
    assert response.status_code == 200
    assert response.json() == {"path": "/v1/embeddings", "echo": orjson.dumps(payload).decode()}
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert after.json() == {"path": "/v1/files", "echo": ""}


async def test_one_access_log_line_per_request_with_usage(
    fake_engine: FakeEngine, gateway_factory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await gateway_factory([fake_engine.url])
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = {"model": "fake-model", "prompt": "hi", "stream": True, "fake": {"chunks": 4}}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": "log-1"}
        ) as response:
            await response.aread()
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    assert len(lines) == 2
    line = lines[0]
    assert line["id"] == "log-1" and line["status"] == 200 and line["streamed"] is True
    assert line["backend"] == f"127.0.0.1:{fake_engine.port}"
    assert line["prompt_tokens"] == 7 and line["completion_tokens"] == 4
    assert line["ending"] == "done" and 0 < line["ttft_s"] <= line["total_s"]
    assert line["reason"] is None
    assert lines[1]["status"] == 404 and lines[1]["ending"] == "bad_request"
    assert lines[1]["reason"] == "model_not_found"


async def test_access_lines_of_refusals_say_why(
    fake_engine: FakeEngine, refused_url: str, gateway_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """429 and 503 lines carry the reason the client got in `x-kvgate-reason`."""
    limited = await gateway_factory(
        [fake_engine.url],
        policy="static-qps",
        baseline=BaselineOptions(qps=0.001, burst=1),
    )
    unreachable = await gateway_factory([refused_url])
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = {"model": "fake-model", "prompt": "hi"}
    statuses = []
    for gw in (limited, limited, unreachable):
        async with httpx.AsyncClient(base_url=gw.url) as client:
            response = await client.post("/v1/completions", json=body)
        statuses.append((response.status_code, response.headers.get("x-kvgate-reason")))
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    assert statuses == [(200, None), (429, "qps_limit"), (503, "no_backend")]
    assert [(line["status"], line["ending"], line["reason"]) for line in lines] == [
        (200, "done", None),
        (429, "rejected", "qps_limit"),
        (503, "rejected", "no_backend"),
    ]


@pytest.mark.parametrize("cut", [1, 2, 4, 5])
async def test_events_cut_inside_data_are_counted_once(
    fake_engine: FakeEngine, gateway_factory, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    """The relay counts `data:` without decoding: an event whose `data:` arrives in two
    reads is still one event (the count is the completion tokens when the engine sends no
    usage), and the bytes reach the client unchanged."""
    gw = await gateway_factory([fake_engine.url])
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = {"model": "fake-model", "prompt": "hi", "stream": True,
            "fake": {"chunks": 6, "usage": False, "split": cut}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            relayed = await response.aread()
    assert relayed.count(b"data: ") == 7  # 6 tokens and [DONE]
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    assert [line["completion_tokens"] for line in lines] == [6]


async def test_a_slow_reader_holds_the_engine_back(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """Back-pressure: while the client does not read, the gateway stops reading upstream,
    so the engine blocks instead of the gateway buffering the whole 32 MB stream."""
    gw = await gateway_factory([fake_engine.url])
    body = {"model": "fake-model", "prompt": "p", "stream": True,
            "fake": {"chunks": 2000, "pad": 16384}}  # fmt: skip
    client = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "slow-read"})
    await client.read_until(b"\r\n\r\n")
    await asyncio.sleep(1.0)  # the client reads nothing more meanwhile
    stalled = fake_engine.by_id("slow-read")
    assert stalled.completed_at is None
    assert stalled.chunks_sent < 1000  # under 16 MB in flight across every buffer
    events, tail = await client.count_to_end(b"data: ", within=30.0)
    assert events == 2002 and tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert fake_engine.by_id("slow-read").completed_at is not None


async def test_without_a_known_context_a_request_without_max_tokens_gets_the_planned_cap(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """The engine lists no context length: the plan assumed `default_max_tokens`, and the
    engine must not generate past it."""
    gw = await gateway_factory([fake_engine.url])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        capped = await client.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "hi", "max_tokens": 7},
            headers={"X-Request-Id": "with-cap"},
        )
        uncapped = await client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Request-Id": "no-cap"},
        )
    assert capped.status_code == uncapped.status_code == 200
    assert orjson.loads(fake_engine.by_id("with-cap").body)["max_tokens"] == 7
    sent = orjson.loads(fake_engine.by_id("no-cap").body)
    assert sent["max_tokens"] == AdmissionSettings().default_max_tokens
    assert sent["messages"] == [{"role": "user", "content": "hi"}]


class _Expecting(RecordingPolicy):
    """Records the output each admitted request was planned to produce."""

    def __init__(self) -> None:
        super().__init__()
        self.expected: list[int] = []

    def _decide(self, now, request, expected, promised):  # type: ignore[no-untyped-def]
        self.expected.append(expected)
        return super()._decide(now, request, expected, promised)


async def test_without_max_tokens_the_body_goes_as_sent_and_the_cap_is_the_rest_of_the_context(
    engine_factory, gateway_factory
) -> None:
    """The engine lists a 2,048-token context: a 1,629-token chat without `max_tokens` is
    relayed as the client sent it (vLLM's chat generates up to the other 419), planned with that
    cap, and, once the model's lengths are learned, expected to run as long as they say. (The
    engine's `/tokenize` counts the prompt: 6,500 characters at 4 a token, 4 for the role.)"""
    engine = await engine_factory(max_model_len=2048, tokenize=True)  # 5 output tokens
    policy = _Expecting()
    gw = await gateway_factory([engine.url], policy=policy)
    await gw.gateway.catalog.refresh()
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 6500}]}
    sent = orjson.dumps(chat)
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for i in range(20):
            headers["x-request-id"] = f"open-{i}"
            response = await client.post("/v1/chat/completions", content=sent, headers=headers)
            assert response.status_code == 200, response.text
    assert engine.by_id("open-0").body == sent
    assert engine.by_id("open-19").body == sent
    costs = [cost for _, cost, _ in policy.admitted]
    assert {(c.prompt_tokens, c.max_output_tokens, c.open_output) for c in costs} == {
        (1629, 2048 - 1629, True)
    }
    assert policy.expected[0] == 2048 - 1629  # nothing learned yet: the cap
    assert policy.expected[-1] == 5  # learned from the model's finished requests


@pytest.mark.parametrize("max_model_len", [2048, None])
async def test_a_vllm_completion_without_max_tokens_costs_its_16_and_goes_as_sent(
    engine_factory, gateway_factory, max_model_len: int | None
) -> None:
    """vLLM's `/v1/completions` generates 16 tokens when `max_tokens` is absent (OpenAI's
    default; only its chat runs to the end of the context): that is the cost, and the body
    goes upstream as sent whether or not the context is known."""
    engine = await engine_factory(max_model_len=max_model_len)
    policy = _Expecting()
    gw = await gateway_factory([engine.url], policy=policy)
    await gw.gateway.catalog.refresh()
    sent = orjson.dumps({"model": "fake-model", "prompt": list(range(10, 1639))})
    headers = {"content-type": "application/json", "x-request-id": "sixteen"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.post("/v1/completions", content=sent, headers=headers)
    assert response.status_code == 200, response.text
    assert engine.by_id("sixteen").body == sent
    [(_, cost, _)] = policy.admitted
    assert (cost.prompt_tokens, cost.max_output_tokens, cost.prompt_exact) == (1629, 16, True)
