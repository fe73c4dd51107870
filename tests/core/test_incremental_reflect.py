"""Incremental reflection gives exactly what re-walking every live hold at every sample gives.

The reference below walks every live hold of the node at every sample (O(live holds)), the
oracle; both policies are driven through the same random streams of admissions, first
tokens, token counts, releases and samples (stale, equal-time, gauge-less ones included),
and their books must agree after every step.
"""

from __future__ import annotations

import random

import pytest

from kvgate.core.admission import Admit, Outcome, Ticket
from kvgate.core.clock import Clock, ManualClock
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Book, Hold, Holds
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.baselines import POLICY_NAMES, NonePolicy, build_named
from kvgate.core.replicas.claims import Claims
from kvgate.core.request import Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.testing.books import full_reserved_on

from .helpers import admission_settings, request

NODES = ("a", "b", "c")


class WalkingHolds(Holds):
    """Reflection by walking every live hold of the node, at every sample."""

    def schedule(self, hold: Hold, touched_at: float | None = None) -> None:
        return

    def reflect(self, book: Book, sample: NodeSample) -> None:
        if sample.kv_usage is None:
            return
        cutoff = sample.sampled_at - self.reflect_margin_s
        overhead = self.overhead
        for hold in book.holds.values():
            first = hold.ticket.first_token_at
            if first is None or first > cutoff:
                continue
            reflected = hold.prompt + hold.known_by(cutoff)
            reflected = min(max(reflected, hold.reflected), hold.full - overhead)
            delta = reflected - hold.reflected
            if delta:
                hold.reflected = reflected
                book.upper -= delta
                book.now -= delta


class WalkingPolicy(NonePolicy):
    """The `none` policy with `WalkingHolds` in place of its holds."""

    def __init__(self, settings: AdmissionSettings, clock: Clock, *, rng_seed: int) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed)
        self.holds = WalkingHolds(self.tuning)
        self.forecast = Forecast(settings, clock, self.holds, self.pace)
        self.claims = Claims(settings, self.nodes, self.holds, self.forecast)


def _books(policy: BasePolicy, node: str) -> tuple[int, int, int]:
    return (
        policy.holds.reserved_on(node),
        policy.holds.unreflected_now(node),
        full_reserved_on(policy, node),
    )


def _drive(seed: int, margin: float, steps: int) -> int:
    """Run one random stream through both policies; returns how many samples changed books."""
    rng = random.Random(seed)
    settings = admission_settings(
        reflect_margin_s=margin, reservation_overhead_tokens=rng.choice([0, 16])
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
            pair = [p.admit(request(f"r{step}", c, Priority.STANDARD, NODES)) for p in policies]
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
            before = _books(policies[1], node)
            for p in policies:
                p.observe(node, sample)
            changed += _books(policies[1], node) != before
        else:
            dt = rng.choice([0.0, 0.01, 0.05, 0.1, 0.3])
            for clock in clocks:
                clock.advance(dt)
        for node in NODES:
            assert _books(policies[0], node) == _books(policies[1], node), step
        for ours, theirs in live:
            assert ours.key == theirs.key
            assert (
                policies[0].holds.live[ours.key].reflected
                == policies[1].holds.live[theirs.key].reflected
            )
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
    return clock, NonePolicy(admission_settings(), clock, rng_seed=1)


def _admit_counted(policy: NonePolicy, request_id: str, tokens: int) -> Ticket:
    """A 100 + 100 token request admitted on node "a" that reported `tokens` streamed."""
    decision = policy.admit(request(request_id, RequestCost(100, 100)))
    assert isinstance(decision, Admit)
    policy.on_tokens(decision.ticket, tokens)
    return decision.ticket


def test_settled_holds_are_not_looked_at_again() -> None:
    """A hold whose counts a sample already shows is off the queue: O(changes) per sample."""
    clock, policy = _none_policy()
    tickets = [_admit_counted(policy, f"r{i}", 10) for i in range(200)]
    clock.advance(1.0)
    policy.observe("a", NodeSample(0.5, 100_000, 200, 0, 0.02, sampled_at=clock.now()))
    assert policy.holds.reserved_on("a") == 200 * (216 - 110)
    assert not policy.holds.books["a"].wakeups  # everything is settled
    policy.on_tokens(tickets[0], 20)
    assert len(policy.holds.books["a"].wakeups) == 1


@pytest.mark.parametrize("name", sorted(POLICY_NAMES))
def test_every_policy_reflects_what_a_sample_shows(name: str) -> None:
    """Every policy (their own helper methods included) lowers a reservation the same way."""
    clock = ManualClock(0.0)
    settings = admission_settings(reservation_overhead_tokens=16)
    policy = build_named(name, settings, clock, rng_seed=1)
    assert isinstance(policy, BasePolicy)
    policy.observe("a", NodeSample(0.1, 100_000, 0, 0, 0.02, sampled_at=clock.now()))
    decision = policy.admit(request("r", RequestCost(300, 200), Priority.CRITICAL))
    assert isinstance(decision, Admit)
    assert policy.holds.reserved_on("a") == 516
    policy.on_first_token(decision.ticket)
    clock.advance(0.3)
    policy.on_tokens(decision.ticket, 50)
    clock.advance(0.3)
    policy.observe("a", NodeSample(0.1, 100_000, 1, 0, 0.02, sampled_at=clock.now()))
    assert policy.holds.reserved_on("a") == 516 - 300 - 50
    assert policy.holds.unreflected_now("a") == 16  # the block rounding: all else is in the sample
    policy.release(decision.ticket, Outcome.DONE)
    assert policy.holds.reserved_on("a") == 0 and policy.holds.unreflected_now("a") == 0


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
    assert len(policy.holds.books["a"].wakeups) <= 2 * 10 + 64 + 1
    assert policy.holds.reserved_on("a") == 10 * 216
