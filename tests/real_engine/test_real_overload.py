"""The overload burst through kvgate: it waits in the gateway and is served whole, the
engine never preempts, and clients that will not wait get 429 with a predicted Retry-After.

The same burst straight to vLLM (the session's `direct_burst`, asserted in
test_real_vllm_direct.py) fills the KV cache and preempts. Through kvgate with its
defaults but one, the requests that cannot start wait in kvgate's queue (not in the
engine's KV cache) until room frees, so a client that never retries is served in full.
The one: the queue may hold the burst nearly as long as its clients wait (a slower
machine's engine needs more than the default 30 s of sheddable work to start the last
requests). While that queue is full, clients sending `X-Kvgate-Max-Wait-Ms: 0` (a decision
at once) are refused at once with 429, an OpenAI-shaped error and a Retry-After computed
from what runs and waits: never a 500, never the clamp by default. Behaviour is asserted,
not wall-clock thresholds. The burst is sheddable, which kvgate never plans above the cache
(`real_engine.load.SHEDDABLE`).
"""

from __future__ import annotations

import pytest

from kvgate.core.retry_after import MAX_RETRY_AFTER_S
from kvgate.core.settings import AdmissionSettings
from real_engine.conftest import (
    BURST_MAX_TOKENS,
    BURST_N,
    BURST_PROMPT_TOKENS,
    GatewayFactory,
)
from real_engine.engine import ServerProcess, record_figure, thrashing_seen
from real_engine.load import Outcome, QueuedBurst, queued_burst

pytestmark = pytest.mark.real_engine

IMPATIENT = 6  # clients sent with `X-Kvgate-Max-Wait-Ms: 0` while the burst waits
CLIENT_WAIT_S = 110.0  # how long the burst's clients wait (`queued_burst`'s timeout)
QUEUE_WAIT_S = 100.0
DEFAULTS = AdmissionSettings()


@pytest.mark.timeout(240)  # one burst: 16 x 120 decode steps, ~15-60 s on 2 shared cores
async def test_an_overload_burst_waits_in_kvgate_and_is_served_whole(
    burst_prompt: str, start_gateway: GatewayFactory, idle_engine: ServerProcess
) -> None:
    # The burst's clients wait CLIENT_WAIT_S: the queue may hold them nearly that long, so
    # that the engine's speed decides whether the burst is served whole, not a default
    # bound (30 s for sheddable work) that a slower machine's engine needs more than to
    # start the burst's last wave.
    gateway = start_gateway("adaptive", queue__max_wait_s=f'{{"sheddable": {QUEUE_WAIT_S}}}')
    result = await queued_burst(
        gateway.url,
        idle_engine.url,
        burst_prompt,
        BURST_N,
        BURST_MAX_TOKENS,
        IMPATIENT,
        timeout_s=CLIENT_WAIT_S,
    )
    record_figure(
        f"burst {BURST_N} x ({BURST_PROMPT_TOKENS} + {BURST_MAX_TOKENS}) through kvgate,"
        f" with clients that will not wait",
        result.summary(),
    )
    _assert_served_whole_without_preemption(result)
    _assert_impatient_refused_with_a_prediction(result)


def _assert_served_whole_without_preemption(result: QueuedBurst) -> None:
    burst = result.burst
    summary = result.summary()
    # Every request of the burst was answered 200 and ran to its full length.
    assert [o.status for o in burst.outcomes] == [200] * BURST_N, summary
    assert all(o.completion_tokens == BURST_MAX_TOKENS for o in burst.outcomes), summary
    # It was an overload for kvgate: half the burst or more waited in its queue, every
    # one of those started later, and nothing is left waiting.
    counters = result.queue["counters"]
    assert counters.get("queued", 0) >= BURST_N // 2, summary
    assert counters.get("admitted_after_wait", 0) == counters["queued"], summary
    assert result.queue["waiting"] == 0, summary
    # The engine never preempted (its counter, and the live sign of it) and its KV cache
    # stayed under the panic watermark that kvgate plans to.
    assert burst.preemptions == 0, summary
    assert not thrashing_seen(burst.samples), summary
    assert burst.samples, "no metrics page of the engine arrived during the burst"
    assert max(s.kv_usage for s in burst.samples) < DEFAULTS.panic_watermark, summary


def _assert_impatient_refused_with_a_prediction(result: QueuedBurst) -> None:
    impatient = result.impatient
    summary = result.summary()
    # The queue held requests for long enough to meet several impatient clients.
    assert len(impatient) >= 3, summary
    for outcome in impatient:
        _assert_a_429_to_retry(outcome, summary)
    # Refused at once, not held: each answered sooner than the burst's median request was
    # served (milliseconds against seconds; the median leaves room for a stalled machine).
    served = result.burst.median_admitted_latency()
    assert max(o.latency_s for o in impatient) < served, summary
    # Retry-After is a prediction, not the clamp.
    clamp = MAX_RETRY_AFTER_S
    assert min(float(o.retry_after_ms or "nan") for o in impatient) < clamp * 1000, summary


def _assert_a_429_to_retry(outcome: Outcome, summary: str) -> None:
    assert outcome.status == 429, (outcome, summary)
    assert outcome.reason, outcome  # X-Kvgate-Reason says why
    error = outcome.error
    assert error is not None, outcome  # an OpenAI-shaped body
    assert error["type"] == "rate_limit_error" and error["message"], outcome
    assert set(error) == {"message", "type", "param", "code"}, outcome
    # Whole seconds, at least 1: the finer retry-after-ms rounded up.
    assert outcome.retry_after is not None and outcome.retry_after_ms is not None, outcome
    seconds = int(outcome.retry_after)
    assert seconds >= 1, outcome
    assert seconds - 1 <= int(outcome.retry_after_ms) / 1000 <= seconds, outcome
