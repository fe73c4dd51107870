"""The overload burst through kvgate: shed early with 429, no preemption, faster answers.

The same burst straight to vLLM (the session's `direct_burst`, asserted in
test_real_vllm_direct.py) thrashes the KV cache. Through kvgate's adaptive policy part of
it must be refused at once with 429 + Retry-After, the engine must not preempt, and the
requests that were admitted must finish sooner than the same requests did without kvgate.
Behaviour is asserted, not wall-clock thresholds.
"""

from __future__ import annotations

import pytest

from real_engine.conftest import (
    BURST_MAX_TOKENS,
    BURST_N,
    BURST_PROMPT_TOKENS,
    TOLERANT_OF_SLOW_SCRAPES,
    GatewayFactory,
)
from real_engine.engine import ServerProcess, record_figure, thrashing_seen
from real_engine.load import BurstResult, burst

pytestmark = pytest.mark.real_engine


@pytest.mark.timeout(300)  # two ~10-30 s bursts (the direct one runs here if not yet run)
async def test_burst_through_kvgate_is_shed_without_preemption(
    direct_burst: BurstResult,
    burst_prompt: str,
    start_gateway: GatewayFactory,
    idle_engine: ServerProcess,
) -> None:
    gateway = start_gateway("adaptive", **TOLERANT_OF_SLOW_SCRAPES)
    result = await burst(gateway.url, idle_engine.url, burst_prompt, BURST_N, BURST_MAX_TOKENS)
    name = f"burst {BURST_N} x ({BURST_PROMPT_TOKENS} + {BURST_MAX_TOKENS}) through kvgate"
    record_figure(name, result.summary())

    statuses = sorted({o.status for o in result.outcomes})
    assert statuses == [200, 429], result.summary()
    # Shed with a usable Retry-After (whole seconds, at least 1).
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in result.shed)
    # Admitted requests ran to their full length.
    assert all(o.completion_tokens == BURST_MAX_TOKENS for o in result.admitted)
    # No preemption: neither counted by the engine nor seen live.
    assert result.preemptions == 0, result.summary()
    assert not thrashing_seen(result.samples), result.summary()
    # The admitted requests finished sooner than the same requests without kvgate.
    assert result.median_admitted_latency() < direct_burst.median_admitted_latency(), (
        f"through kvgate: {result.summary()}; direct: {direct_burst.summary()}"
    )
    # And kvgate shed them early instead of holding them: refusals are immediate.
    assert max(o.latency_s for o in result.shed) < min(o.latency_s for o in result.admitted)
