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
    GatewayFactory,
)
from real_engine.engine import ServerProcess, record_figure, thrashing_seen, wait_idle
from real_engine.load import BurstResult, burst

pytestmark = pytest.mark.real_engine


@pytest.mark.timeout(300)  # up to three ~3-30 s bursts (the direct one runs here if not yet run)
async def test_burst_through_kvgate_is_shed_without_preemption(
    direct_burst: BurstResult,
    burst_prompt: str,
    start_gateway: GatewayFactory,
    idle_engine: ServerProcess,
) -> None:
    gateway = start_gateway("adaptive")
    name = f"burst {BURST_N} x ({BURST_PROMPT_TOKENS} + {BURST_MAX_TOKENS}) through kvgate"
    for attempt in range(LATENCY_ATTEMPTS):
        if attempt:
            await wait_idle(idle_engine.url)
        result = await burst(gateway.url, idle_engine.url, burst_prompt, BURST_N, BURST_MAX_TOKENS)
        record_figure(name if not attempt else f"{name}, attempt {attempt + 1}", result.summary())
        _assert_shed_without_preemption(result)
        # The admitted requests finished sooner than the same requests without kvgate. The
        # one wall-clock comparison here: a stall of the machine during this burst alone (a
        # 4 s one, injected, took it from 2.9 to 6.7 s against 7.7 s direct) is retried; a
        # kvgate that really slows them fails every attempt.
        if result.median_admitted_latency() < direct_burst.median_admitted_latency():
            return
    raise AssertionError(
        f"admitted requests were not faster through kvgate in {LATENCY_ATTEMPTS} bursts:"
        f" {result.summary()}; direct: {direct_burst.summary()}"
    )


LATENCY_ATTEMPTS = 2


def _assert_shed_without_preemption(result: BurstResult) -> None:
    """What every burst through kvgate must show, stalled machine or not."""
    statuses = sorted({o.status for o in result.outcomes})
    assert statuses == [200, 429], result.summary()
    # Shed with a usable Retry-After (whole seconds, at least 1).
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in result.shed)
    # Admitted requests ran to their full length.
    assert all(o.completion_tokens == BURST_MAX_TOKENS for o in result.admitted)
    # No preemption: neither counted by the engine nor seen live.
    assert result.preemptions == 0, result.summary()
    assert not thrashing_seen(result.samples), result.summary()
    # And kvgate shed them early instead of holding them: refusals are immediate.
    assert max(o.latency_s for o in result.shed) < min(o.latency_s for o in result.admitted)
