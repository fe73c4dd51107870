"""An engine behind TLS: `kvgate serve` in front of an `https://` backend.

Everything that talks to an engine does it over TLS here: the scraper (the node must be
fresh for the adaptive policy to admit anything), the model list and the relay, streamed
and not. The engine's certificate is self-signed, so the gateway process is told to trust
it the way an operator with a private CA would: `SSL_CERT_FILE`.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvgate.testing import FakeEngine, free_port


@pytest.fixture
async def tls_engine(self_signed: tuple[Path, Path]) -> AsyncIterator[FakeEngine]:
    cert, key = self_signed
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    engine = await FakeEngine(tls=context).start()
    try:
        yield engine
    finally:
        await engine.stop()


def _serve(engine: FakeEngine, port: int, cafile: Path | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_SCRAPE__INTERVAL_S"] = "0.1"
    if cafile is not None:
        env["SSL_CERT_FILE"] = str(cafile)
    argv = [sys.executable, "-m", "kvgate", "serve", "--port", str(port)]
    argv += ["--backend", engine.url, "--log-level", "warning"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _ready(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False


async def test_an_https_engine_is_scraped_and_served(
    tls_engine: FakeEngine, self_signed: tuple[Path, Path]
) -> None:
    assert tls_engine.url.startswith("https://")
    port = free_port()
    gateway = _serve(tls_engine, port, cafile=self_signed[0])
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = asyncio.get_running_loop().time() + 30
            while not await _ready(client):
                assert gateway.poll() is None, gateway.stderr.read() if gateway.stderr else ""
                assert asyncio.get_running_loop().time() < deadline, "never ready over TLS"
                await asyncio.sleep(0.1)
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["fake-model"]
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4 "
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            assert streamed.status_code == 200, streamed.text
            assert streamed.text.count("data: ") == 7 and streamed.text.endswith("[DONE]\n\n")
    finally:
        gateway.terminate()
        gateway.wait(10)
    assert len(tls_engine.completions()) == 2
    assert tls_engine.metrics_hits > 0


async def test_an_untrusted_certificate_is_refused(tls_engine: FakeEngine) -> None:
    """Without the CA the engine is never trusted: not scraped, never ready, nothing sent."""
    port = free_port()
    gateway = _serve(tls_engine, port, cafile=None)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                try:
                    readyz = await client.get("/readyz")
                    break
                except httpx.TransportError:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # several scrape periods
            assert (await client.get("/readyz")).status_code == readyz.status_code == 503
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code in (404, 503), answer.text
    finally:
        gateway.terminate()
        gateway.wait(10)
    assert tls_engine.completions() == []
