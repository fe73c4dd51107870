"""Backends from settings, and the abort APIs against real HTTP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvgate.adapters import adapter_for
from kvgate.adapters.backend import Backend, host_port, unique
from kvgate.adapters.settings import BackendSettings
from kvgate.adapters.vllm import VllmAdapter, vllm_engine_ids


def test_backend_defaults() -> None:
    b = Backend.from_settings(BackendSettings(url="http://10.0.0.5:8000/"))
    assert b.node_id == "10.0.0.5:8000"
    assert b.base_url == "http://10.0.0.5:8000"
    assert b.metrics_url == "http://10.0.0.5:8000/metrics"
    assert b.engine == "vllm" and isinstance(b.adapter, VllmAdapter)
    assert b.auth_headers() == {}


def test_backend_dialect_defaults_and_overrides() -> None:
    trt = Backend.from_settings(BackendSettings(url="https://trt.example", engine="trtllm"))
    assert trt.node_id == "trt.example:443"
    assert trt.metrics_url == "https://trt.example/prometheus/metrics"
    triton = Backend.from_settings(BackendSettings(url="http://tr:8000", engine="triton"))
    assert triton.metrics_url == "http://tr:8002/metrics"
    named = Backend.from_settings(
        BackendSettings(
            url="http://[::1]:9000",
            engine="tgi",
            name="tgi-1",
            metrics_url="http://[::1]:9001/m",
            api_key="s3cret",
            kv_capacity_tokens=16000,
        )
    )
    assert named.node_id == "tgi-1" and named.metrics_url == "http://[::1]:9001/m"
    assert named.auth_headers() == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(named)
    assert host_port("http://[::1]:9000") == "[::1]:9000"


def backends_from_settings(settings: list[BackendSettings]) -> list[Backend]:
    """Every backend of `settings`, as the gateway builds them (node ids checked)."""
    return unique([Backend.from_settings(s) for s in settings])


def test_duplicate_node_ids_and_bad_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="share the node id"):
        backends_from_settings(
            [BackendSettings(url="http://a:1"), BackendSettings(url="http://a:1")]
        )
    with pytest.raises(ValueError, match="http"):
        Backend.from_settings(BackendSettings(url="ftp://a"))


def test_each_node_gets_its_own_adapter_state() -> None:
    a, b = backends_from_settings(
        [BackendSettings(url="http://a:1"), BackendSettings(url="http://b:1")]
    )
    assert a.adapter is not b.adapter


def test_vllm_engine_ids() -> None:
    both = ["chatcmpl-abc", "cmpl-abc-0"]
    for chat in ("chat", "/v1/chat/completions", "/v1/chat/completions/"):
        assert vllm_engine_ids("abc", chat) == ["chatcmpl-abc"]
    for completion in ("completions", "/v1/completions"):
        assert vllm_engine_ids("abc", completion) == ["cmpl-abc-0"]
    for other in (None, "", "/v1/*", "/v1/embeddings", "embeddings"):
        assert vllm_engine_ids("abc", other) == both


class AbortServer:
    """A real HTTP server standing in for an engine's abort endpoint."""

    def __init__(self) -> None:
        self.status = 200
        self.calls: list[tuple[str, object, str | None]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(
            (request.path, await request.json(), request.headers.get("Authorization"))
        )
        return web.json_response({}, status=self.status)


@pytest.fixture
async def abort_server() -> AsyncIterator[tuple[AbortServer, str]]:
    server = AbortServer()
    app = web.Application()
    app.router.add_post("/inference/v1/abort_requests", server.handle)
    app.router.add_post("/abort_request", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_vllm_abort_posts_engine_ids(abort_server: tuple[AbortServer, str]) -> None:
    server, url = abort_server
    adapter = adapter_for("vllm")
    async with aiohttp.ClientSession() as session:
        ok = await adapter.abort(
            session,
            url,
            "r1",
            endpoint="/v1/chat/completions",  # what the proxy passes: the request path
            headers={"Authorization": "Bearer k"},
        )
    assert ok is True
    assert server.calls == [
        ("/inference/v1/abort_requests", {"request_ids": ["chatcmpl-r1"]}, "Bearer k")
    ]


async def test_vllm_abort_403_is_remembered(abort_server: tuple[AbortServer, str]) -> None:
    """Without --enable-scale-out vLLM answers 403: say False, quietly, and stop asking."""
    server, url = abort_server
    server.status = 403
    adapter = adapter_for("vllm")
    async with aiohttp.ClientSession() as session:
        assert await adapter.abort(session, url, "r1") is False
        assert await adapter.abort(session, url, "r2") is False
    assert len(server.calls) == 1


async def test_sglang_abort(abort_server: tuple[AbortServer, str]) -> None:
    server, url = abort_server
    async with aiohttp.ClientSession() as session:
        assert await adapter_for("sglang").abort(session, url, "rid-7") is True
    assert server.calls == [("/abort_request", {"rid": "rid-7"}, None)]


async def test_abort_to_a_dead_engine_is_false_not_an_exception() -> None:
    async with aiohttp.ClientSession() as session:
        for kind in ("vllm", "sglang"):
            assert await adapter_for(kind).abort(session, "http://127.0.0.1:9", "x") is False


@pytest.mark.parametrize("kind", ["trtllm", "triton", "tgi", "llamacpp"])
async def test_engines_without_abort_api_return_false(kind: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert await adapter_for(kind).abort(session, "http://127.0.0.1:9", "x") is False
