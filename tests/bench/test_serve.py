"""The benchmark's own gateway: `python -m kvgate.bench.serve --baseline NAME` admits with
that baseline and its quotas, and refuses what a baseline cannot do."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest
from gateway.helpers import until_ready

from kvgate.testing import FakeEngine, free_port

pytestmark = pytest.mark.timeout(60)


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.bench.serve", *args]


async def test_a_baseline_gateway_admits_with_its_quota(fake_engine: FakeEngine) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    argv = ["--baseline", "static-qps", "--qps", "0.001", "--burst", "1"]
    argv += ["--backend", fake_engine.url, "--port", str(port), "--log-level", "info"]
    process = await asyncio.create_subprocess_exec(
        *_serve(*argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert await until_ready(client)
            body = {"model": "fake-model", "prompt": "p"}
            first = await client.post("/v1/completions", json=body)
            second = await client.post("/v1/completions", json=body)
            state = (await client.get("/admin/state")).json()
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 15)
    assert first.status_code == 200
    assert second.status_code == 429 and second.headers["x-kvgate-reason"] == "qps_limit"
    assert state["policy"]["policy"] == "static-qps"
    assert b"policy static-qps" in stderr  # the start-up line names it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--baseline", "none", "--workers", "2"], "a baseline policy runs in one process"),
        (["--baseline", "static-qps", "--qps", "0"], "qps must be positive"),
    ],
)
def test_what_a_baseline_gateway_refuses(argv: list[str], message: str) -> None:
    done = subprocess.run(_serve(*argv), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_kvgate_serve_has_no_policy_to_choose() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--policy", "none"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "unrecognized arguments: --policy" in done.stderr
