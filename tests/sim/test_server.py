"""The live simulator over real HTTP on 127.0.0.1: OpenAI API, ids, aborts, bad input."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer

pytestmark = pytest.mark.timeout(60)


def url(sim: SimServer) -> str:
    return f"http://127.0.0.1:{sim.port}"


async def test_streamed_token_count_equals_max_tokens_with_ignore_eos(
    sim_server: SimServer,
) -> None:
    client = openai.AsyncOpenAI(base_url=url(sim_server) + "/v1", api_key="x", max_retries=0)
    stream = await client.completions.create(
        model="sim-llama",
        prompt=list(range(300)),
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, reasons = "", None, []
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(text.split()) == 40  # one word per token
    assert usage is not None and usage.completion_tokens == 40 and usage.prompt_tokens == 300
    assert reasons[-1] == "length"
    chat = await client.chat.completions.create(
        model="sim-llama",
        messages=[{"role": "user", "content": "x" * 400}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 7
    assert chat.usage.prompt_tokens == 100 + 4  # 400 chars / 4 + the template's tokens
    assert len(chat.choices[0].message.content.split()) == 7
    await client.close()


async def test_request_id_models_health_and_metrics(sim_server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=url(sim_server)) as http:
        r = await http.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True},
            headers={"X-Request-Id": "abc"},
        )
        assert r.status_code == 200 and r.json()["id"] == "cmpl-abc"
        r = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"X-Request-Id": "xyz"},
        )
        assert r.json()["id"] == "chatcmpl-xyz"
        assert (await http.get("/health")).status_code == 200
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == "sim-llama"
        page = (await http.get("/metrics")).text
        fams = {f.name: f for f in text_string_to_metric_families(page)}
        assert fams["vllm:generation_tokens"].samples[0].value >= 4
        assert fams["vllm:request_success"].type == "counter"
        # As vLLM: `/metrics/` answers `name[]` with only those samples; `/metrics` ignores it.
        query = {"name[]": ["vllm:num_requests_running", "vllm:generation_tokens_total"]}
        named = (await http.get("/metrics/", params=query)).text
        assert [f.name for f in text_string_to_metric_families(named)] == [
            "vllm:num_requests_running",
            "vllm:generation_tokens",
        ]
        assert "vllm:kv_cache_usage_perc{" in (await http.get("/metrics", params=query)).text


async def test_client_disconnect_aborts_at_next_step(sim_server: SimServer) -> None:
    engine = sim_server.engine
    async with httpx.AsyncClient(base_url=url(sim_server)) as http:
        async with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": [1] * 200, "max_tokens": 1000, "ignore_eos": True, "stream": True},
            headers={"X-Request-Id": "gone"},
        ) as response:
            lines = response.aiter_lines()
            for _ in range(6):
                await anext(lines)
            assert "cmpl-gone-0" in engine and engine.used_blocks > 0
    for _ in range(100):
        if "cmpl-gone-0" not in engine:
            break
        await asyncio.sleep(0.01)
    assert "cmpl-gone-0" not in engine
    assert engine.used_blocks == 0
    assert engine.zombie_tokens_total <= 2  # at most the step in flight


async def test_non_streaming_disconnect_aborts_too(sim_server: SimServer) -> None:
    engine = sim_server.engine
    async with httpx.AsyncClient(base_url=url(sim_server)) as http:
        task = asyncio.create_task(
            http.post(
                "/v1/completions",
                json={"prompt": "a" * 400, "max_tokens": 1500, "ignore_eos": True},
                headers={"X-Request-Id": "quiet"},
            )
        )
        for _ in range(100):
            if engine.output_tokens("cmpl-quiet-0") > 3:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for _ in range(100):
        if "cmpl-quiet-0" not in engine:
            break
        await asyncio.sleep(0.01)
    assert "cmpl-quiet-0" not in engine and engine.used_blocks == 0


async def test_zombie_runs_to_completion_without_abort_on_disconnect() -> None:
    cfg = dataclasses.replace(CPU_TINY, abort_on_disconnect=False)
    sim = SimServer(Engine(cfg, seed=0))
    await sim.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url(sim)) as http:
            async with http.stream(
                "POST",
                "/v1/completions",
                json={"prompt": [1] * 10, "max_tokens": 60, "ignore_eos": True, "stream": True},
                headers={"X-Request-Id": "z"},
            ) as response:
                lines = response.aiter_lines()
                for _ in range(4):
                    await anext(lines)
        for _ in range(200):
            if "cmpl-z-0" not in sim.engine:
                break
            await asyncio.sleep(0.01)
        assert sim.engine.success_total["length"] == 1
        assert 40 < sim.engine.zombie_tokens_total < 60
    finally:
        await sim.close()


async def test_abort_requests_endpoint(sim_server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=url(sim_server)) as http:
        task = asyncio.create_task(
            http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 1500,
                    "ignore_eos": True,
                },
                headers={"X-Request-Id": "kill"},
            )
        )
        for _ in range(100):
            if "chatcmpl-kill" in sim_server.engine:
                break
            await asyncio.sleep(0.01)
        r = await http.post(
            "/inference/v1/abort_requests", json={"request_ids": ["chatcmpl-kill", "nope"]}
        )
        assert r.json() == {"aborted": ["chatcmpl-kill"]}
        response = await task
        assert response.status_code == 500
        assert "error" in response.json()
    assert sim_server.engine.used_blocks == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", b"[1, 2]", 400, None),
        ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 99999}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n"),
        ("/v1/completions", b'{"prompt": "x", "model": "other"}', 404, "model"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
        ("/v1/completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages"),
        ("/inference/v1/abort_requests", b'{"request_ids": "x"}', 400, "request_ids"),
    ],
)
async def test_bad_input_gets_openai_style_errors(
    sim_server: SimServer, path: str, body: bytes, status: int, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=url(sim_server)) as http:
        r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["code"] == status
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/nope")).status_code == 404


async def test_a_failed_engine_answers_500_instead_of_hanging(sim_server: SimServer) -> None:
    def broken(now: float) -> float | None:
        raise RuntimeError("model bug")

    sim_server.engine.begin_step = broken  # type: ignore[method-assign]
    async with httpx.AsyncClient(base_url=url(sim_server), timeout=10) as http:
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 500 and "error" in r.json()
        assert (await http.get("/health")).status_code == 500
