"""Two kvgate replicas sharing a real redis-server, in front of the one real vLLM engine.

The overload burst (16 x 500 prompt tokens, 120 output tokens, ignore_eos: straight to
vLLM it preempts) is split between the two replicas, half to each, all at once. As one
gateway they must serve every request in full (the ones without room wait in their
replica's queue) and the engine must not preempt: each replica plans the other's requests
and starts its own only within its share of the engine's room. The burst is sheddable,
which kvgate never plans above the cache (`real_engine.load.SHEDDABLE`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate.procs.redis_server import RedisServer, find_redis_server
from real_engine.conftest import (
    BURST_MAX_TOKENS,
    BURST_N,
    BURST_PROMPT_TOKENS,
    GatewayFactory,
)
from real_engine.engine import (
    MODEL_NAME,
    MetricsRecorder,
    ServerProcess,
    poll_until,
    record_figure,
    thrashing_seen,
)
from real_engine.load import SHEDDABLE, BurstResult, Outcome

pytestmark = pytest.mark.real_engine


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own (CI installs Debian's package; skip locally)."""
    if find_redis_server() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is required in CI")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with RedisServer.start(port=0) as server:
        yield server


async def _in_sync(urls: list[str], within: float = 30.0) -> None:
    """Every replica syncs with the store and sees both."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            states = [(await client.get(f"{url}/admin/state")).json() for url in urls]
            if all(
                s["cluster"]["state"] == "synced" and s["cluster"]["replicas"] == len(urls)
                for s in states
            ):
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the replicas never saw each other: {[s['cluster'] for s in states]}")


async def _completion(
    client: httpx.AsyncClient, url: str, prompt: str, reasons: list[str]
) -> Outcome:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": BURST_MAX_TOKENS,
        "ignore_eos": True,
    }
    started = time.monotonic()
    response = await client.post(url + "/v1/completions", json=body, headers=SHEDDABLE)
    tokens = None
    if response.status_code == 200:
        tokens = int(response.json()["usage"]["completion_tokens"])
    else:
        reasons.append(f"{response.status_code} {response.headers.get('x-kvgate-reason')}")
    return Outcome(
        response.status_code,
        time.monotonic() - started,
        response.headers.get("retry-after"),
        tokens,
    )


async def _split_burst(
    urls: list[str], engine_url: str, prompt: str, reasons: list[str]
) -> BurstResult:
    """BURST_N requests at once, spread round-robin over `urls`; the engine watched; the
    reason of every refusal goes to `reasons`."""
    limits = httpx.Limits(max_connections=BURST_N, max_keepalive_connections=BURST_N)
    async with httpx.AsyncClient(timeout=10.0) as probe:
        before = await poll_until(probe, engine_url, lambda _: True, timeout_s=60.0)
    async with httpx.AsyncClient(timeout=150.0, limits=limits) as client:
        started = time.monotonic()
        async with MetricsRecorder(engine_url) as recorder:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        _completion(client, urls[i % len(urls)], prompt, reasons)
                        for i in range(BURST_N)
                    )
                ),
                150.0,
            )
        wall = time.monotonic() - started
    async with httpx.AsyncClient(timeout=10.0) as probe:
        after = await poll_until(probe, engine_url, lambda _: True, timeout_s=60.0)
    preempted = after.preemptions_total - before.preemptions_total
    return BurstResult(list(outcomes), recorder.samples, preempted, wall)


@pytest.mark.timeout(300)
async def test_two_replicas_serve_the_burst_whole_without_preemption(
    redis: RedisServer,
    burst_prompt: str,
    start_gateway: GatewayFactory,
    idle_engine: ServerProcess,
    direct_burst: BurstResult,
) -> None:
    # The default bound (30 s), or three times what the engine took to serve the burst
    # alone where that is longer: no request is refused that the engine starts within it
    # (on an AVX2-only machine, judged on the first scrape of the burst, whose prefills
    # stalled every decode, 11 of 16 were refused as 75-150 s away in a burst served in
    # 15 s; `kvgate.core.plan.pace` says why that no longer happens).
    bound = max(30.0, 3 * direct_burst.wall_s)
    replicas = [
        start_gateway(
            "adaptive", store__url=redis.url, queue__max_wait_s=f'{{"sheddable": {bound:.0f}}}'
        )
        for _ in range(2)
    ]
    urls = [replica.url for replica in replicas]
    await _in_sync(urls)
    reasons: list[str] = []
    result = await _split_burst(urls, idle_engine.url, burst_prompt, reasons)
    record_figure(
        f"burst {BURST_N} x ({BURST_PROMPT_TOKENS} + {BURST_MAX_TOKENS}) through two"
        " replicas sharing a redis-server",
        result.summary() + (f", refusals {sorted(reasons)}" if reasons else ""),
    )
    assert sorted({o.status for o in result.outcomes}) == [200], (result.summary(), reasons)
    assert all(o.completion_tokens == BURST_MAX_TOKENS for o in result.outcomes)
    assert result.preemptions == 0, result.summary()
    assert not thrashing_seen(result.samples), result.summary()
