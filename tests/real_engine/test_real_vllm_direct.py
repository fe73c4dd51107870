"""Baselines straight against the real vLLM engine, without kvgate.

They pin down the engine facts that kvgate relies on (metric names, capacity, abort on
disconnect, preemption under overload), so that a failure in the kvgate tests can be told
apart from a change in the engine.
"""

from __future__ import annotations

import httpx
import pytest

from real_engine.engine import (
    MODEL_NAME,
    ServerProcess,
    read_metrics,
    record_figure,
    thrashing_seen,
)
from real_engine.load import (
    LONGEST_OUTPUT,
    BurstResult,
    describe,
    disconnect_attempts,
    gone_in_time,
    measure_disconnect,
)

pytestmark = pytest.mark.real_engine


async def test_metrics_page_has_what_kvgate_reads(
    idle_engine: ServerProcess, engine_client: httpx.AsyncClient
) -> None:
    metrics = await read_metrics(engine_client, idle_engine.url)
    # serve.sh: 8 MiB of KV = 128 blocks of 32 tokens; cache_config_info carries both.
    assert metrics.capacity_tokens == 4096
    assert (metrics.running, metrics.waiting) == (0, 0)
    assert 0.0 <= metrics.kv_usage <= 1.0


async def test_engine_aborts_a_stream_when_its_client_disconnects(
    idle_engine: ServerProcess,
) -> None:
    """Reference figure for the kvgate cancellation tests: the engine's own reaction."""
    body = {
        "model": MODEL_NAME,
        "prompt": "def main():",
        "max_tokens": LONGEST_OUTPUT,
        "ignore_eos": True,
        "stream": True,
    }
    results = await disconnect_attempts(
        lambda: measure_disconnect(
            idle_engine.url,
            idle_engine.url,
            body,
            chunks_first=5,
            ready=None,  # its tokens say it runs: hang up after the 5th
            gone=lambda m: m.running == 0 and m.waiting == 0,
        )
    )
    record_figure("direct to vLLM, mid-stream disconnect -> gone", describe(results))
    assert results[-1].chunks_before >= 5
    assert gone_in_time(results[-1]), describe(results)


def test_overload_burst_straight_to_vllm_preempts(direct_burst: BurstResult) -> None:
    """16 x 500 prompt tokens with ignore_eos on a 4,096-token KV cache thrash the engine."""
    assert [o.status for o in direct_burst.outcomes] == [200] * len(direct_burst.outcomes)
    assert all(
        o.completion_tokens == direct_burst.extra["max_tokens"] for o in direct_burst.admitted
    )
    # The preemption counter is the proof that the cache ran out. It lags (a preemption is
    # counted when its victim runs again), but every request has finished by now, so every
    # preemption has been counted.
    assert direct_burst.preemptions > 0, direct_burst.summary()
    # What the polls saw is only recorded. The instant the cache is full lasts one step
    # and the page can lag far behind the engine on a stalled machine: CI runs saw peaks
    # of 0.94 and (in a run whose GETs also timed out) 0.13, both with 2 preemptions.
    record_figure(
        "burst straight to vLLM: peak KV cache use seen in the polls",
        f"{max((s.kv_usage for s in direct_burst.samples), default=0.0):.2f}",
    )
    # Likewise the live sign (running falls while waiting rises at a nearly full cache):
    # one run on a loaded machine counted 2 preemptions and saw no such pair of polls.
    record_figure(
        "burst straight to vLLM: preemption's live sign seen in the polls",
        "yes" if thrashing_seen(direct_burst.samples) else "no (the counter shows it)",
    )
