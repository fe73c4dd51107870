"""kvgate in front of the real vLLM: what its scraper sees, and how requests are relayed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from real_engine.conftest import GatewayFactory
from real_engine.engine import (
    MODEL_NAME,
    EngineMetrics,
    ServerProcess,
    exact_prompt,
    free_port,
    poll,
    read_metrics,
    record_figure,
    spawn,
    wait_ready,
)
from real_engine.load import BLOCKED_PROMPT_TOKENS, ResponseEndedFirst, full_kv_cache

pytestmark = pytest.mark.real_engine

STATE_LAG_BOUND_S = 0.2  # the target: /admin/state shows an engine change within 200 ms


def _scraped(state: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's last sample as kvgate's scraper reports it (one backend here)."""
    nodes = state["scraper"]["nodes"]
    (node,) = nodes.values()
    return node["last_sample"]


async def _first_time(
    read: Any, condition: Any, timeout_s: float = 10.0, interval_s: float = 0.01
) -> tuple[float, Any]:
    """Poll `read()` until `condition(value)`; returns (arrival time, value)."""
    value = await poll(read, condition, timeout_s, interval_s)
    return time.monotonic(), value


async def _lag(
    client: httpx.AsyncClient,
    engine_url: str,
    gateway_url: str,
    engine_condition: Any,
    state_condition: Any,
) -> tuple[float, EngineMetrics, dict[str, Any]]:
    """Time from the engine's own page showing a change to /admin/state showing it."""

    async def engine_page() -> EngineMetrics:
        return await read_metrics(client, engine_url)

    (engine_at, metrics), (state_at, sample) = await asyncio.gather(
        _first_time(engine_page, engine_condition),
        _first_time(
            lambda: _state(client, gateway_url), lambda s: s is not None and state_condition(s)
        ),
    )
    return state_at - engine_at, metrics, sample


@pytest.mark.timeout(300)  # retries may fill the engine several times
async def test_scraper_reads_the_real_metrics_page(
    start_gateway: GatewayFactory, idle_engine: ServerProcess
) -> None:
    gateway = start_gateway()  # default scrape settings
    async with httpx.AsyncClient(timeout=10.0) as client:
        state = (await client.get(gateway.url + "/admin/state")).json()
        sample = _scraped(state)
        assert sample is not None, state
        # Capacity comes from vllm:cache_config_info (128 blocks x 32 tokens).
        assert sample["kv_capacity_tokens"] == 4096
        assert (sample["running"], sample["waiting"], sample["kv_usage"]) == (0, 0, 0.0)
        # kvgate polls vLLM's narrowed page (`/metrics/?name[]=...`, ~2 KB instead of
        # ~50 KB) once a check shows it carries every metric the full page does. A check
        # that could not decide (a stalled machine) is made again 30 s later.
        _, node = await _first_time(
            lambda: _node(client, gateway.url), lambda n: n["page"] == "narrowed", 75.0, 0.05
        )
        assert "/metrics/?name%5B%5D=vllm%3A" in node["metrics_url"]
        assert node["last_sample"]["kv_capacity_tokens"] == 4096

        prompt = await exact_prompt(client, idle_engine.url, 400)
        lags: list[tuple[float, float]] = []
        for _ in range(3):  # retried only against noise from other work on the machine
            lags.append(await _one_change(client, idle_engine.url, gateway.url, prompt))
            if max(lags[-1]) < STATE_LAG_BOUND_S:
                break
        record_figure(
            "/admin/state behind the engine's own page (request started, request gone)",
            ", ".join(f"{up * 1000:.0f} ms / {down * 1000:.0f} ms" for up, down in lags),
        )
        assert max(lags[-1]) < STATE_LAG_BOUND_S, lags

        # Waiting: a request that cannot fit in the engine's full KV cache is queued.
        blocked_prompt = await exact_prompt(client, idle_engine.url, BLOCKED_PROMPT_TOKENS)
        waiting_lags: list[float | None] = []
        for _ in range(4):  # retried only against noise, as above
            lag: float | None = None  # None: a missed attempt
            with contextlib.suppress(ResponseEndedFirst):
                lag = await _one_queued(client, idle_engine.url, gateway.url, blocked_prompt)
            waiting_lags.append(lag)
            if lag is not None and lag < STATE_LAG_BOUND_S:
                break
    record_figure(
        "/admin/state behind the engine's own page (a request queued)",
        ", ".join("missed" if lag is None else f"{lag * 1000:.0f} ms" for lag in waiting_lags),
    )
    last = waiting_lags[-1]
    assert last is not None and last < STATE_LAG_BOUND_S, waiting_lags


async def _one_queued(
    client: httpx.AsyncClient, engine_url: str, gateway_url: str, blocked_prompt: str
) -> float:
    """Queue one request behind a full KV cache, straight at the engine; returns how far
    /admin/state lagged the engine's page in showing it waiting.

    Raises `ResponseEndedFirst` (a missed attempt) if the request was answered before any
    page showed it waiting, or no filling was seen: on a loaded machine vLLM's API server
    updates its page late, so a page that shows the fillers early in their run may already
    be stale, and the request may find room at once.
    """
    async with full_kv_cache(engine_url) as full:
        body = {"model": MODEL_NAME, "prompt": blocked_prompt, "max_tokens": 16}
        blocked = asyncio.create_task(client.post(engine_url + "/v1/completions", json=body))
        seen = asyncio.create_task(
            _lag(
                client,
                engine_url,
                gateway_url,
                lambda m: m.waiting == 1,
                lambda s: s["waiting"] == 1,
            )
        )
        try:
            await asyncio.wait({blocked, seen}, return_when=asyncio.FIRST_COMPLETED)
            if not seen.done():
                raise ResponseEndedFirst("answered before any page showed it waiting")
            waiting_lag, _, sample = seen.result()
            assert sample["running"] == full.running
            assert sample["kv_usage"] >= full.kv_usage
        finally:
            for task in (seen, blocked):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
    return waiting_lag


async def _node(client: httpx.AsyncClient, gateway_url: str) -> dict[str, Any]:
    """The scraper's view of the one engine: which page it polls, and its last sample."""
    nodes = (await client.get(gateway_url + "/admin/state")).json()["scraper"]["nodes"]
    (node,) = nodes.values()
    return dict(node)


async def _state(client: httpx.AsyncClient, gateway_url: str) -> dict[str, Any] | None:
    return _scraped((await client.get(gateway_url + "/admin/state")).json())


async def _one_change(
    client: httpx.AsyncClient, engine_url: str, gateway_url: str, prompt: str
) -> tuple[float, float]:
    """Start one long request straight at the engine (kvgate does not know of it), then
    abort it; returns how far /admin/state lagged the engine's page each time."""
    # As long as the context allows (400 + 1,648 tokens): still running when both pages
    # have shown it, whatever the engine's speed.
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2048 - 400, "ignore_eos": True}
    request = asyncio.create_task(client.post(engine_url + "/v1/completions", json=body))
    try:
        lag_up, _, sample = await _lag(
            client,
            engine_url,
            gateway_url,
            lambda m: m.running == 1 and m.kv_usage > 0,
            lambda s: s["running"] == 1 and s["kv_usage"] > 0,
        )
        # 400 prompt tokens hold at least 13 of 128 blocks: read as a 0-1 fraction.
        assert 0.1 <= sample["kv_usage"] <= 1.0
        assert sample["waiting"] == 0
    finally:
        request.cancel()  # the client goes away: vLLM aborts the request
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await request
    lag_down, _, _ = await _lag(
        client,
        engine_url,
        gateway_url,
        lambda m: m.running == 0,
        lambda s: s["running"] == 0 and s["kv_usage"] == 0,
    )
    return lag_up, lag_down


@pytest.fixture
async def openai_client(start_gateway: GatewayFactory) -> Any:
    gateway = start_gateway()
    client = AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


async def test_openai_client_lists_the_model(openai_client: AsyncOpenAI) -> None:
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


# Seeded sampling is deterministic in vLLM (and the random weights are fixed for the
# engine's lifetime), so a relayed answer must equal, token for token, the engine's own
# answer to the same request, streamed or not.
COMPLETION = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 24, "seed": 7}
CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Write a for loop."}],
    "max_tokens": 16,
    "seed": 7,
}
VLLM_ONLY = {"ignore_eos": True}  # vLLM's own field: kvgate must pass it through


async def _direct(engine_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60.0) as client:
        response = await client.post(engine_url + path, json={**body, **VLLM_ONLY})
        response.raise_for_status()
        return response.json()


async def test_completion_relays_exactly(
    openai_client: AsyncOpenAI, idle_engine: ServerProcess
) -> None:
    reference = await _direct(idle_engine.url, "/v1/completions", COMPLETION)
    expected_text = reference["choices"][0]["text"]
    assert reference["usage"]["completion_tokens"] == 24 and expected_text

    whole = await openai_client.completions.create(**COMPLETION, extra_body=VLLM_ONLY)
    assert whole.model == MODEL_NAME
    assert whole.choices[0].text == expected_text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.model_dump() == {**reference["usage"], **whole.usage.model_dump()}

    stream = await openai_client.completions.create(
        **COMPLETION,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=VLLM_ONLY,
    )
    pieces: list[str] = []
    finish: list[str | None] = []
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish.append(choice.finish_reason)
    assert "".join(pieces) == expected_text
    # No chunk count is asserted: vLLM merges pending deltas into one chunk when its
    # consumer lags (measured: 2 chunks for 24 tokens on a busy machine).
    assert [f for f in finish if f] == ["length"]
    assert usage is not None and usage.completion_tokens == 24


async def test_chat_relays_exactly(openai_client: AsyncOpenAI, idle_engine: ServerProcess) -> None:
    reference = await _direct(idle_engine.url, "/v1/chat/completions", CHAT)
    expected = reference["choices"][0]["message"]["content"]
    assert reference["usage"]["completion_tokens"] == 16 and expected

    whole = await openai_client.chat.completions.create(**CHAT, extra_body=VLLM_ONLY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 16

    stream = await openai_client.chat.completions.create(
        **CHAT,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=VLLM_ONLY,
    )
    roles: list[str] = []
    content: list[str] = []
    finish: list[str | None] = []
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            content.append(choice.delta.content or "")
            finish.append(choice.finish_reason)
    assert roles[:1] == ["assistant"]
    assert "".join(content) == expected
    assert [f for f in finish if f] == ["length"]
    assert usage is not None and usage.completion_tokens == 16


async def test_over_long_requests_get_the_engines_own_400_from_kvgate(
    start_gateway: GatewayFactory, idle_engine: ServerProcess
) -> None:
    """What vLLM refuses for its length (max_model_len 2048), kvgate refuses itself in the
    engine's words (as its own error: code and X-Kvgate-Reason `context_length_exceeded`),
    without sending it; what vLLM serves cut short, kvgate sends."""
    gateway = start_gateway()
    long_ids = {"model": MODEL_NAME, "prompt": list(range(10, 3010)), "max_tokens": 10}
    much_output = {**CHAT, "max_tokens": 3000}
    # 1,000 + 1,100 tokens: over the context, served with the output cut at 2,048 - 1,000.
    cut_short = {"model": MODEL_NAME, "prompt": list(range(10, 1010)), "max_tokens": 1100}
    async with httpx.AsyncClient(timeout=60.0) as client:
        for path, body in [
            ("/v1/completions", long_ids),
            ("/v1/chat/completions", much_output),
            ("/v1/completions", {**cut_short, **VLLM_ONLY}),
        ]:
            # Through kvgate first: the engine's own answer must not leave KV in use that
            # kvgate's next sample would still show.
            relayed = await client.post(gateway.url + path, json=body)
            direct = await client.post(idle_engine.url + path, json=body)
            assert relayed.status_code == direct.status_code, (body, relayed.text)
            if direct.status_code == 400:
                mine, engines = relayed.json()["error"], direct.json()["error"]
                assert (mine["message"], mine["param"]) == (engines["message"], engines["param"])
                assert mine["code"] == "context_length_exceeded"
                assert mine["type"] == "invalid_request_error"
                assert relayed.headers["x-kvgate-reason"] == "context_length_exceeded"
            else:
                assert "x-kvgate-reason" not in relayed.headers
                assert relayed.json()["usage"]["completion_tokens"] == 2048 - 1000


async def test_without_max_tokens_vllm_generates_the_rest_of_its_context_through_kvgate_too(
    start_gateway: GatewayFactory, idle_engine: ServerProcess
) -> None:
    """A chat request without `max_tokens`: vLLM generates up to the rest of its
    2,048-token context (end-of-sequence ignored: to the very end), over 1,024 tokens after
    a prompt of about 900. Through kvgate the same: it sends no `max_tokens` of its own (it
    sent 1,024, which cut the answer there)."""
    gateway = start_gateway()
    messages = [{"role": "user", "content": " self" * 900}]
    body = {"model": MODEL_NAME, "messages": messages, **VLLM_ONLY}
    async with httpx.AsyncClient(timeout=180.0) as client:
        relayed = await client.post(gateway.url + "/v1/chat/completions", json=body)
        direct = await client.post(idle_engine.url + "/v1/chat/completions", json=body)
    assert relayed.status_code == direct.status_code == 200, relayed.text
    assert "x-kvgate-reason" not in relayed.headers
    usage = relayed.json()["usage"]
    assert usage == direct.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 2048
    assert usage["completion_tokens"] > 1024


async def test_an_engine_added_by_a_reload_is_scraped_and_served(
    tmp_path: Path, idle_engine: ServerProcess
) -> None:
    """The real engine joins a running gateway: the file names it, then SIGHUP. It must be
    scraped (on its narrowed page), make the gateway ready, and serve a completion."""
    path = tmp_path / "kvgate.yaml"
    settings = "server: {log_level: info}\n"
    path.write_text("backends: [{url: 'http://127.0.0.1:9', name: placeholder}]\n" + settings)
    port = free_port()
    argv = [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--port", str(port)]
    server = spawn("kvgate", argv, port, tmp_path / "kvgate-reload.log")
    try:
        wait_ready(server, "/healthz", timeout_s=30.0)
        path.write_text(f"backends: ['{idle_engine.url}']\n" + settings)
        assert server.proc is not None
        async with httpx.AsyncClient(timeout=60.0) as client:
            sent_at = time.monotonic()
            os.kill(server.proc.pid, signal.SIGHUP)
            ready_at, _ = await _first_time(  # /readyz: the new node has a fresh sample
                lambda: client.get(server.url + "/readyz"), lambda r: r.status_code == 200, 30.0
            )
            record_figure(
                "reload: SIGHUP to /readyz 200 with the real engine added",
                f"{(ready_at - sent_at) * 1000:.0f} ms",
            )
            _, node = await _first_time(
                lambda: _node(client, server.url), lambda n: n["page"] == "narrowed", 75.0, 0.05
            )
            assert node["last_sample"]["kv_capacity_tokens"] == 4096
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
            response = await client.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        log = server.log_path.read_text()
        assert "backends changed: added 127.0.0.1:" in log and "removed placeholder" in log
    finally:
        server.stop(grace_s=10.0)


async def test_an_engine_found_by_dns_is_scraped_and_served(
    tmp_path: Path, idle_engine: ServerProcess
) -> None:
    """`discover: dns` on `localhost` (the system resolver): the real engine behind it is a
    backend named after the entry, scraped on its narrowed page, and serves."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        f"backends: [{{url: 'http://localhost:{idle_engine.port}', name: vllm, discover: dns}}]\n"
    )
    port = free_port()
    argv = [sys.executable, "-m", "kvgate", "serve", "--config", str(path), "--port", str(port)]
    server = spawn("kvgate", argv, port, tmp_path / "kvgate-dns.log")
    try:
        wait_ready(server, "/readyz", timeout_s=30.0)
        async with httpx.AsyncClient(timeout=60.0) as client:
            _, node = await _first_time(
                lambda: _node(client, server.url), lambda n: n["page"] == "narrowed", 75.0, 0.05
            )
            assert node["node_id"] == f"vllm@127.0.0.1:{idle_engine.port}"
            body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
            response = await client.post(server.url + "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop(grace_s=10.0)
