"""The scraper and the vLLM adapter against the engine simulator (kvgate.sim) over real
HTTP: its metrics page follows vLLM's, its abort API takes vLLM's engine ids."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings, ScrapeSettings
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies import build_policy
from kvgate.core.policies.base import BasePolicy
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway.engines.scraper import Scraper
from kvgate.sim.server import SimServer

pytestmark = pytest.mark.timeout(60)


async def _until(predicate: object, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_scraper_follows_the_simulated_engine_and_aborts_by_id(sim_server: SimServer) -> None:
    clock = MonotonicClock()
    policy = build_policy(AdmissionSettings(), clock)
    assert isinstance(policy, BasePolicy)
    backend = Backend.from_settings(BackendSettings(url=f"http://127.0.0.1:{sim_server.port}"))
    async with aiohttp.ClientSession() as session:
        scraper = Scraper([backend], ScrapeSettings(interval_s=0.05), policy, None, clock)
        async with scraper:
            await _until(lambda: scraper.last_sample(backend.node_id) is not None)
            idle = scraper.last_sample(backend.node_id)
            assert idle is not None and idle.kv_capacity_tokens == 128 * 32
            assert idle.running == 0 and idle.kv_usage == 0.0

            async def generate(request_id: str) -> int:
                async with session.post(
                    f"{backend.base_url}/v1/completions",
                    json={"prompt": "x" * 2000, "max_tokens": 1500, "ignore_eos": True},
                    headers={"X-Request-Id": request_id},
                ) as resp:
                    await resp.read()
                    return resp.status

            tasks = [asyncio.create_task(generate(f"r{i}")) for i in range(3)]

            def busy() -> bool:
                s = scraper.last_sample(backend.node_id)
                return s is not None and s.running == 3 and s.iteration_latency_s is not None

            await _until(busy)
            sample = scraper.last_sample(backend.node_id)
            assert sample is not None and sample.kv_usage is not None and sample.kv_usage > 0
            assert policy.nodes[backend.node_id].is_fresh(clock.now(), policy.settings)

            # the simulator accepts vLLM's abort API: aborting by X-Request-Id frees the node
            for i in range(3):
                assert await backend.adapter.abort(
                    session, backend.base_url, f"r{i}", endpoint="completions"
                )
            statuses = await asyncio.gather(*tasks)
            assert all(status >= 400 for status in statuses)  # aborted, not completed

            def drained() -> bool:
                s = scraper.last_sample(backend.node_id)
                return s is not None and s.running == 0 and s.kv_usage == 0.0

            await _until(drained)
        assert scraper.stats()[backend.node_id].failures_total == 0
