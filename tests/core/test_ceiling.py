"""The measured ceiling (`kvgate.core.plan.ceiling`) on a ManualClock: who may be planned
above the cache, what takes the overbooking back, and thrashing as a measurement."""

from __future__ import annotations

import pytest

from kvgate.core.admission import Admit, Outcome, Reject, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.plan.ceiling import (
    COLLAPSE,
    HOLD_S,
    LATENCY,
    OVERBOOK_MAX,
    OVERBOOKING,
    RAMP_S,
    RAMPING,
    NodeCeiling,
    cheap,
)
from kvgate.core.plan.meter import NodeMeter
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import Priority
from kvgate.core.signals import NodeSample

from .helpers import admit, assert_books_empty, cost, make, request

PANIC = 0.92
CAP = 10_000
STEP = 0.005


def _sample(
    clock: ManualClock,
    usage: float,
    preemptions: float | None = 0.0,
    running: int = 1,
    waiting: int = 0,
    latency: float | None = STEP,
) -> NodeSample:
    return NodeSample(usage, CAP, running, waiting, latency, clock.now(), preemptions)


def _fill(policy: BasePolicy, c: tuple[int, int], n: int, priority: Priority) -> list[Ticket]:
    """Admit up to `n` requests of cost `c` on node "a"; the admitted tickets."""
    tickets = []
    for i in range(n):
        decision = admit(policy, f"r{len(tickets)}-{i}", cost(*c), priority)
        if isinstance(decision, Admit):
            tickets.append(decision.ticket)
    return tickets


def _peak(policy: BasePolicy) -> float:
    value = policy.snapshot()["nodes"]["a"]["peak_usage"]
    assert isinstance(value, float)
    return value


def _release(policy: BasePolicy, tickets: list[Ticket]) -> None:
    for ticket in tickets:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


# --- the controller alone ---------------------------------------------------------------------


def test_a_cut_holds_then_the_overbooking_is_regained_over_the_ramp() -> None:
    control, meter = NodeCeiling(), NodeMeter()
    assert control.overbook == OVERBOOK_MAX and control.reason == OVERBOOKING
    control._cut(10.0, LATENCY, "TPOT")
    assert control.overbook == 0 and control.reason == LATENCY
    assert not control.allows(10.0, Priority.STANDARD, meter)
    control.judge(10.0, meter, 0)
    control.judge(10.0 + HOLD_S - 0.1, meter, 0)
    assert control.overbook == 0  # held while the evidence is fresh
    control.judge(10.0 + HOLD_S, meter, 0)
    control.judge(10.0 + HOLD_S + RAMP_S / 2, meter, 0)
    assert control.overbook == pytest.approx(OVERBOOK_MAX / 2)
    assert control.reason == RAMPING
    control.judge(10.0 + HOLD_S + RAMP_S, meter, 0)
    assert control.overbook == OVERBOOK_MAX and control.reason == OVERBOOKING


def test_sheddable_work_is_never_placed_above_the_cache_critical_only_while_fast() -> None:
    control, meter = NodeCeiling(), NodeMeter()
    assert control.allows(0.0, Priority.STANDARD, meter)
    assert control.allows(0.0, Priority.CRITICAL, meter)
    assert not control.allows(0.0, Priority.SHEDDABLE, meter)
    meter.sampled(0.0, STEP, None, (), STEP, True, 4)
    t = 0.0
    for _ in range(100):  # 4 streams at 8 idle steps per token: standard's target holds
        t += 8 * STEP
        meter.produced(t, 4)
        meter.sampled(t, STEP, None, (), STEP, True, 4)
    control.judge(t, meter, 0)
    assert control.allows(t, Priority.STANDARD, meter)
    assert not control.allows(t, Priority.CRITICAL, meter)


def test_recomputation_is_cheap_or_dear_by_the_measured_prefill_pace() -> None:
    cpu, gpu = NodeMeter(), NodeMeter()
    cpu.sampled(0.0, 0.003, None, (), 0.003, True, 0)
    gpu.sampled(0.0, 0.007, None, (), 0.007, True, 0)
    for _ in range(4):
        cpu.first_token(1000, 0.03)  # the real CPU engine: ~25-30 ms for a 1k prompt
        gpu.first_token(100_000, 4.5)  # gpu-8b: a 100k prompt prefills in seconds
    assert cheap(cpu, 800, 300)  # a long prompt on the CPU engine
    assert cheap(cpu, 50, 150) and cheap(gpu, 50, 150)  # chats everywhere
    assert not cheap(gpu, 100_000, 300)  # a long prompt on the GPU
    assert gpu.recompute_s(100_300) > 4.0


# --- in the policy ----------------------------------------------------------------------------


def test_cheap_requests_are_planned_above_the_cache_where_preemptions_are_counted() -> None:
    measured, clock = make("adaptive")
    measured.observe("a", _sample(clock, 0.5))
    tickets = _fill(measured, (200, 2000), 20, Priority.STANDARD)
    # 5,000 held; each needs 2,216 at its end: 1 fits under the panic watermark, and each
    # prompt fits the cache now: the plan goes above it.
    assert len(tickets) > 5 and _peak(measured) > 1.0
    snap = measured.snapshot()["nodes"]["a"]
    assert snap["ceiling"] == pytest.approx(PANIC + OVERBOOK_MAX)
    assert snap["ceiling_reason"] == OVERBOOKING
    assert snap["measured"]["idle_step_s"] == pytest.approx(STEP)
    _release(measured, tickets)

    for policy_name, preemptions in (("adaptive-fixed", 0.0), ("adaptive", None)):
        # kvgate's fixed ceiling, and an engine that counts no preemptions: the watermarks.
        policy, clock = make(policy_name)
        policy.observe("a", _sample(clock, 0.5, preemptions))
        tickets = _fill(policy, (200, 2000), 20, Priority.STANDARD)
        assert len(tickets) == 1 and _peak(policy) <= PANIC
        assert policy.snapshot()["nodes"]["a"]["ceiling_reason"] == "fixed"
        _release(policy, tickets)


def test_requests_dear_to_recompute_and_sheddable_work_stay_under_the_watermarks() -> None:
    policy, clock = make("adaptive")
    policy.observe("a", _sample(clock, 0.5))
    # A long prompt with a short answer: one preemption would cost more than its decode.
    assert len(_fill(policy, (2000, 100), 20, Priority.STANDARD)) == 1
    assert _peak(policy) <= PANIC
    policy2, clock2 = make("adaptive")
    policy2.observe("a", _sample(clock2, 0.5))
    assert len(_fill(policy2, (200, 2000), 20, Priority.SHEDDABLE)) <= 1
    assert _peak(policy2) <= PANIC


def test_a_slow_measured_prefill_makes_the_same_request_dear() -> None:
    policy, clock = make("adaptive")
    policy.observe("a", _sample(clock, 0.5))
    probes = _fill(policy, (3000, 10), 1, Priority.STANDARD)
    clock.advance(3.0)  # 1 ms per prompt token: 200 tokens of 5 ms steps each
    policy.on_first_token(probes[0])
    _release(policy, probes)
    policy.observe("a", _sample(clock, 0.5))
    tickets = _fill(policy, (200, 2000), 20, Priority.STANDARD)
    assert len(tickets) == 1 and _peak(policy) <= PANIC
    _release(policy, tickets)


def test_planned_preemption_is_not_thrashing_until_goodput_falls() -> None:
    policy, clock = make("adaptive")
    assert isinstance(policy, AdaptivePolicy)
    policy.observe("a", _sample(clock, 0.5))
    tickets = _fill(policy, (200, 2000), 20, Priority.STANDARD)
    assert _peak(policy) > 1.0
    for ticket in tickets:
        policy.on_first_token(ticket)
    produced = 0
    for _ in range(40):  # 2 s of every stream getting a token per step
        clock.advance(0.05)
        produced += 10
        for ticket in tickets:
            policy.on_tokens(ticket, produced)
        policy.observe("a", _sample(clock, 0.95, running=len(tickets)))
    # The engine preempts its newest requests, as the plan allowed: the engine's business.
    clock.advance(0.05)
    policy.observe("a", _sample(clock, 1.0, 2.0, running=len(tickets) - 2, waiting=2))
    node = policy.snapshot()["nodes"]["a"]
    assert node["state"] != "thrashing" and node["ceiling_reason"] == OVERBOOKING
    assert node["measured"]["recomputed_tokens"] > 0
    # Then the engine stalls: nothing streams while it keeps preempting.
    for i in range(60):
        clock.advance(0.05)
        policy.observe("a", _sample(clock, 1.0, 3.0 + i, running=4, waiting=8))
    node = policy.snapshot()["nodes"]["a"]
    assert node["ceiling_reason"] == COLLAPSE and node["ceiling"] <= PANIC
    assert node["state"] == "thrashing"  # collapse is kvgate's: the hard gate is back
    _release(policy, tickets)


def test_a_waiter_above_the_cache_is_predicted_to_start_when_the_cache_frees_its_prompt() -> None:
    """A burst planned above the cache must not make the next request's predicted start
    the time the whole overbooked plan falls back under the watermark: it starts above
    the cache as soon as the cache has room for its prompt."""
    policy, clock = make("adaptive")
    assert isinstance(policy, AdaptivePolicy)
    policy.observe("a", _sample(clock, 0.0))
    tickets = []
    for i in range(20):  # ends spread out: the first prompt leaves the cache long before
        tickets += _fill(policy, (1500, 1000 + 500 * i), 1, Priority.STANDARD)
    assert _peak(policy) > 1.0 and len(tickets) >= 4  # the prompts the cache holds now
    waiter = request("w", cost(1500, 2000))
    assert isinstance(policy.admit(waiter), Reject)  # its prompt does not fit the cache now
    node = policy.nodes["a"]
    estimate = policy.start_estimate(waiter)
    assert estimate is not None
    under = policy.forecast.start_estimate(node, 1500 + 2000 + 16, PANIC * CAP)
    assert under is not None and estimate.seconds < under.seconds / 2
    first_end = min(policy.forecast.time_left(policy.holds.live[t.key]) for t in tickets)
    assert estimate.seconds >= first_end * 0.99
    _release(policy, tickets)


def test_a_prompt_whose_prefix_the_node_holds_is_cheap_by_its_own_part() -> None:
    # On an engine with prefix caching (its block size known), a request sharing a long
    # prefix with the requests running there is recomputed as its own part only: the shared
    # blocks stay cached when it is preempted. 1,920 shared tokens + 80 of its own, 100 out.
    shared = tuple(range(1000, 2920))
    cap = 3000
    policy, clock = make("adaptive")
    assert isinstance(policy, AdaptivePolicy)
    page = NodeSample(0.0, cap, 0, 0, STEP, clock.now(), 0.0, block_size=16)
    policy.observe("a", page)
    assert policy.ceilings.is_cheap("a", 80, 100)
    assert not policy.ceilings.is_cheap("a", 2000, 100)
    tickets = []
    for i in range(20):
        ids = shared + tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + 80))
        decision = admit(policy, f"r{i}", cost(2000, 100), prompt_ids=ids)
        if isinstance(decision, Admit):
            tickets.append(decision.ticket)
    # Under the panic watermark, 4 fit (2,116 for the first, 196 for each sharer); planned
    # above it, sharers come until their prompts fill the cache now (2,016 + 96 each).
    assert len(tickets) == 1 + int((PANIC * cap - 2016) // 96)
    assert _peak(policy) > PANIC
    _release(policy, tickets)
    # Without their ids, the same requests are charged their whole prompts: dear, none above.
    policy, clock = make("adaptive")
    policy.observe("a", NodeSample(0.0, cap, 0, 0, STEP, clock.now(), 0.0, block_size=16))
    assert len(_fill(policy, (2000, 100), 20, Priority.STANDARD)) == 1
