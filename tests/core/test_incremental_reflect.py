"""Incremental reflection gives exactly what re-walking every live ticket at every sample gave.

The reference below is the former O(live tickets) `_reflect`, kept here as the oracle; both
policies are driven through the same random streams of admissions, first tokens, token
counts, releases and samples (stale, equal-time, gauge-less ones included), and their books
must agree after every step.
"""

from __future__ import annotations

import random

import pytest

from kvgate.core.admission import Admit, Outcome, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.policies import _REGISTRY, build_policy
from kvgate.core.policies.base import BasePolicy, _Hold
from kvgate.core.policies.none import NonePolicy
from kvgate.core.request import Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

NODES = ("a", "b", "c")


def _known_by(hold: _Hold, cutoff: float) -> int:
    if hold.tok_cur_at <= cutoff:
        return hold.tok_cur
    if hold.tok_prev_at <= cutoff:
        return hold.tok_prev
    return 0


class WalkingPolicy(NonePolicy):
    """The former reflection: every live ticket of the node, at every sample."""

    def _schedule(self, hold: _Hold, touched_at: float | None = None) -> None:
        return

    def _reflect(self, node_id: str, sample: NodeSample) -> None:
        on_node = self._by_node.get(node_id)
        if not on_node or sample.kv_usage is None:
            return
        cutoff = sample.sampled_at - self.settings.reflect_margin_s
        overhead = self.settings.reservation_overhead_tokens
        for hold in on_node.values():
            first = hold.ticket.first_token_at
            if first is None or first > cutoff:
                continue
            reflected = hold.ticket.cost.prompt_tokens + _known_by(hold, cutoff)
            reflected = min(max(reflected, hold.reflected), hold.full - overhead)
            if reflected != hold.reflected:
                hold.reflected = reflected
                self.store.update(node_id, hold.key, hold.full - reflected)


def _drive(seed: int, margin: float, steps: int) -> int:
    """Run one random stream through both policies; returns how many samples changed books."""
    rng = random.Random(seed)
    settings = AdmissionSettings(
        policy="none", reflect_margin_s=margin, reservation_overhead_tokens=rng.choice([0, 16])
    )
    clocks = (ManualClock(10.0), ManualClock(10.0))
    policies = (
        NonePolicy(settings, clocks[0], rng_seed=seed),
        WalkingPolicy(settings, clocks[1], rng_seed=seed),
    )
    live: list[tuple[Ticket, Ticket]] = []
    counts: dict[int, int] = {}
    last_sample = dict.fromkeys(NODES, 10.0)
    changed = 0
    for step in range(steps):
        op = rng.random()
        if op < 0.25:
            c = RequestCost(rng.randint(1, 500), rng.randint(0, 300))
            pair = [p.admit(f"r{step}", c, Priority.STANDARD, NODES) for p in policies]
            assert isinstance(pair[0], Admit) and isinstance(pair[1], Admit)
            live.append((pair[0].ticket, pair[1].ticket))
        elif op < 0.35 and live:
            pair = rng.choice(live)
            for p, t in zip(policies, pair, strict=True):
                p.on_first_token(t)
        elif op < 0.6 and live:
            i = rng.randrange(len(live))
            counts[i] = counts.get(i, 0) + rng.choice([0, 1, 5, 40])
            for p, t in zip(policies, live[i], strict=True):
                p.on_tokens(t, counts[i])
        elif op < 0.7 and live:
            pair = live.pop(rng.randrange(len(live)))
            counts.clear()  # indexes moved; later counts restart from what each ticket had
            for p, t in zip(policies, pair, strict=True):
                p.release(t, Outcome.DONE)
        elif op < 0.9:
            node = rng.choice(NODES)
            now = clocks[0].now()
            at = rng.choice([now, now, now - rng.uniform(0, 0.3), last_sample[node]])
            last_sample[node] = max(last_sample[node], at)
            sample = NodeSample(
                kv_usage=None if rng.random() < 0.1 else rng.random(),
                kv_capacity_tokens=100_000,
                running=1,
                waiting=0,
                iteration_latency_s=0.02,
                sampled_at=at,
            )
            before = policies[1].store.reserved(node)
            for p in policies:
                p.observe(node, sample)
            changed += policies[1].store.reserved(node) != before
        else:
            dt = rng.choice([0.0, 0.01, 0.05, 0.1, 0.3])
            for clock in clocks:
                clock.advance(dt)
        for node in NODES:
            assert policies[0].store.reserved(node) == policies[1].store.reserved(node), step
        for ours, theirs in live:
            assert ours.extra == theirs.extra
    for p in policies:
        for pair in live:
            for t in pair:
                p.release(t, Outcome.DONE)
    return changed


@pytest.mark.parametrize("margin", [0.0, 0.05, 0.1])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_reflection_matches_walking_every_ticket(seed: int, margin: float) -> None:
    changed = _drive(seed, margin, 1200)
    assert changed > 20  # the streams do exercise reflection, not just agree on zero


def _none_policy() -> tuple[ManualClock, NonePolicy]:
    clock = ManualClock(0.0)
    return clock, NonePolicy(AdmissionSettings(policy="none"), clock, rng_seed=1)


def _admit_counted(policy: NonePolicy, request_id: str, tokens: int) -> Ticket:
    """A 100 + 100 token request admitted on node "a" that reported `tokens` streamed."""
    decision = policy.admit(request_id, RequestCost(100, 100), Priority.STANDARD, ("a",))
    assert isinstance(decision, Admit)
    policy.on_tokens(decision.ticket, tokens)
    return decision.ticket


def test_settled_holds_are_not_looked_at_again() -> None:
    """A hold whose counts a sample already shows is off the queue: O(changes) per sample."""
    clock, policy = _none_policy()
    tickets = [_admit_counted(policy, f"r{i}", 10) for i in range(200)]
    clock.advance(1.0)
    policy.observe("a", NodeSample(0.5, 100_000, 200, 0, 0.02, sampled_at=clock.now()))
    assert policy.store.reserved("a") == 200 * (216 - 110)
    assert not policy._wakeups.get("a")  # everything is settled
    policy.on_tokens(tickets[0], 20)
    assert len(policy._wakeups["a"]) == 1


@pytest.mark.parametrize("name", sorted(_REGISTRY))
def test_every_policy_reflects_what_a_sample_shows(name: str) -> None:
    """Every policy (their own helper methods included) lowers a reservation the same way."""
    clock = ManualClock(0.0)
    settings = AdmissionSettings(policy=name, reservation_overhead_tokens=16)  # type: ignore[arg-type]
    policy = build_policy(settings, clock, rng_seed=1)
    assert isinstance(policy, BasePolicy)
    policy.observe("a", NodeSample(0.1, 100_000, 0, 0, 0.02, sampled_at=clock.now()))
    decision = policy.admit("r", RequestCost(300, 200), Priority.CRITICAL, ("a",))
    assert isinstance(decision, Admit)
    assert policy.store.reserved("a") == 516
    policy.on_first_token(decision.ticket)
    clock.advance(0.3)
    policy.on_tokens(decision.ticket, 50)
    clock.advance(0.3)
    policy.observe("a", NodeSample(0.1, 100_000, 1, 0, 0.02, sampled_at=clock.now()))
    assert policy.store.reserved("a") == 516 - 300 - 50
    policy.release(decision.ticket, Outcome.DONE)
    assert policy.store.reserved("a") == 0


def test_queue_stays_bounded_on_a_node_without_kv_gauge() -> None:
    """Nothing is ever reflected without a KV gauge; the queue must not grow per request."""
    clock, policy = _none_policy()
    live = []
    for i in range(2000):
        live.append(_admit_counted(policy, f"r{i}", 1))
        if len(live) > 10:
            policy.release(live.pop(0), Outcome.DONE)
        clock.advance(0.01)
        policy.observe("a", NodeSample(None, None, 10, 0, 0.02, sampled_at=clock.now()))
    assert len(policy._wakeups["a"]) <= 2 * 10 + 64 + 1
    assert policy.store.reserved("a") == 10 * 216
