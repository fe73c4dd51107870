"""Without a store kvgate runs alone, exactly as before; `--workers` without a store or a
redis-server to start says what it needs."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from kvgate.testing import FakeEngine, eventually


async def test_workers_without_a_store_or_redis_server_say_what_they_need() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PATH"] = "/nonexistent"  # no redis-server to be found
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "serve", "--workers", "2",
        "--backend", "http://127.0.0.1:9", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert b"--store" in stderr and b"apt-get install redis-server" in stderr


async def test_without_a_store_a_gateway_runs_alone(
    gateway_factory: Any, fake_engine: FakeEngine
) -> None:
    gw = await gateway_factory([fake_engine.url])
    assert gw.gateway.cluster is None
    assert gw.gateway.state()["cluster"] is None
    assert await eventually(lambda: fake_engine.metrics_hits > 0, 5.0)
