"""Never refuse what the engines will start within the bound (issue 23), in virtual time.

A fresh gateway knows neither how fast its engines step nor how long a model's answers
run; before it does, a prediction is a guess and must not refuse anyone. The bursts of the
issue's findings, through the simulated engines of `kvgate serve` (two `cpu-tiny`), with
clients that wait without a timeout and never retry: every request is served, none refused.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvgate.core.admission import Admit
from kvgate.core.flow import FlowController, Waiter, waits
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import QueueSettings
from kvgate.sim.presets import get_preset
from kvgate.sim.runs import ClientModel, VirtualConfig, VirtualResult
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import RequestSpec, WorkloadSpec

from .helpers import make, sample

BOUND_S = QueueSettings().wait_for(Priority.STANDARD)  # the queue's default: 60 s
PATIENT = ClientModel(timeout_s=1000.0, max_attempts=1, max_429_tries=1)


def _burst(
    n: int, *, warm: int = 0, gateways: int = 1, max_tokens: int = 1800
) -> tuple[VirtualResult, list[float]]:
    """`n` streaming chats (20-token prompts) within `n` ms, once the engines were sampled
    (after `warm` earlier chats taught the gateway, when asked); the burst's results and
    how long each of its requests waited in the gateway's queue."""
    arrivals = [
        RequestSpec(k, 0.5 + 0.01 * k, 20, max_tokens, False, Priority.STANDARD, True)
        for k in range(warm)
    ]
    start = 100.0 if warm else 0.5
    arrivals += [
        RequestSpec(warm + k, start + 0.001 * k, 20, max_tokens, False, Priority.STANDARD, True)
        for k in range(n)
    ]
    config = VirtualConfig(
        engine=get_preset("cpu-tiny"),
        workload=WorkloadSpec(),
        duration_s=start + 2 * BOUND_S,
        nodes=2,
        gateways=gateways,
        policy="adaptive",
        sync_interval_s=0.05 if gateways > 1 else None,
        client=PATIENT,
    )
    result = VirtualCluster(config, arrivals).run()
    result.outcomes = result.outcomes[warm:]
    waited = [t.waited_s for o in result.outcomes for t in o.tries if t.outcome == "ok"]
    return result, waited


@pytest.mark.parametrize(("n", "gateways"), [(40, 1), (40, 2), (200, 1), (200, 2)])
def test_a_fresh_gateway_serves_the_whole_burst(n: int, gateways: int) -> None:
    result, waited = _burst(n, gateways=gateways)
    statuses = Counter(o.status for o in result.outcomes)
    assert statuses == {"ok": n}, statuses
    assert sum(o.rejections_429 for o in result.outcomes) == 0
    assert max(waited) < BOUND_S  # the engines started every one within the bound


def test_a_warm_gateway_counts_the_waiters_ahead_at_their_learned_length() -> None:
    """Warm, 200 concurrent at max_tokens 1,800: once counted at their max_tokens, the
    waiters ahead made the prediction of a wait of 25-30 s that refused 119 of 200."""
    result, waited = _burst(200, warm=20)
    statuses = Counter(o.status for o in result.outcomes)
    assert statuses == {"ok": 200}, statuses
    assert max(waited) < BOUND_S


def _chat(
    rid: str, model: str = "m", output: int = 1800, prompt: int = 20, **fields: object
) -> AdmissionRequest:
    cost = RequestCost(prompt, output)
    return AdmissionRequest(rid, cost, model=model, candidates=("a",), **fields)  # type: ignore[arg-type]


def test_the_waiters_ahead_count_at_their_expected_footprint() -> None:
    policy, clock = make()
    flow = FlowController(policy)
    flow.observe("a", sample(clock, usage=0.0, capacity=4096, latency=0.004))
    for _ in range(20):
        policy.lengths.learn("m", 1800, 100)  # the 90th percentile: 100 tokens
    held = flow.submit(_chat("big", output=20, prompt=3700, exact_output=True))  # fills it
    assert isinstance(held, Admit)
    queued = [flow.submit(_chat(f"w{i}", model)) for i, model in enumerate(["m"] * 5 + ["new"] * 2)]
    assert all(isinstance(w, Waiter) for w in queued), queued
    overhead = policy.tuning.reservation_overhead_tokens
    arrival = _chat("late")
    ahead = waits.ahead(flow.queue, policy, arrival)
    assert ahead.tokens == 7 * (20 + 1800)
    # The five of the learned model at 100 output tokens, the two of the new one at 1,800.
    assert ahead.expected == 5 * (20 + 100 + overhead) + 2 * (20 + 1800 + overhead)
    assert not ahead.informed  # the new model's length is a guess
    for waiter in queued[5:]:
        assert isinstance(waiter, Waiter)
        flow.cancel(waiter)
    assert waits.ahead(flow.queue, policy, arrival).informed


def test_a_prediction_on_a_prior_queues_and_the_deadline_refuses() -> None:
    """A node that never made a token has no measured pace: the wait predicted on the
    prior is not a reason to refuse, the deadline is."""
    policy, clock = make()
    flow = FlowController(policy)
    flow.observe("a", sample(clock, usage=0.0, capacity=4096, latency=None))
    first = flow.submit(_chat("first", output=3000, exact_output=True))
    assert isinstance(first, Admit)
    # At the prior's 10 ms a step, the first ends in 30 s: past this one's 5 s bound.
    second = flow.submit(_chat("second", output=3000, exact_output=True, max_wait_s=5.0))
    assert isinstance(second, Waiter)
    clock.advance(5.0)
    refused = flow.expire(second)
    assert refused.reason == "queue_timeout"  # type: ignore[union-attr]
