"""Node states (unknown, fresh levels, lagging, stale, dead, thrashing) in virtual time:
`NodeState` alone, then what the adaptive policy does in each."""

from __future__ import annotations

import pytest

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.clock import ManualClock
from kvgate.core.nodes import LAG_LIMIT_FACTOR, STATES, NodeState
from kvgate.core.request import Priority
from kvgate.core.settings import AdmissionSettings

from .helpers import admit, assert_books_empty, cost, make, sample

SETTINGS = AdmissionSettings(stale_after_s=1.0).tuned(failures_to_stale=3)


def _node(clock: ManualClock, usage: float = 0.1) -> NodeState:
    node = NodeState("a")
    assert node.accept(sample(clock, usage=usage), clock.now(), SETTINGS)
    return node


def _state(node: NodeState, clock: ManualClock) -> str:
    now = clock.now()
    state = node.state(now, SETTINGS)
    assert state in STATES
    # The three views agree: usable only when fresh or lagging and not thrashing, and
    # live_until is the edge of fresh-or-lagging.
    live = now <= node.live_until(SETTINGS)
    assert live == node.is_live(now, SETTINGS)
    assert node.usable(now, SETTINGS) == (live and not node.thrashing)
    assert live == (state in ("ok", "high", "panic", "lagging", "thrashing"))
    assert node.snapshot(now, SETTINGS)["state"] == state
    return state


def test_never_heard_is_unknown_and_a_refused_one_is_dead() -> None:
    clock = ManualClock(100.0)
    node = NodeState("a")
    assert _state(node, clock) == "unknown"
    node.fail(hard=False)  # a hung first poll: still nobody has heard from it
    assert _state(node, clock) == "unknown"
    for _ in range(3):
        node.fail()
    assert _state(node, clock) == "dead"


def test_fresh_then_stale_by_age_alone() -> None:
    clock = ManualClock(100.0)
    node = _node(clock)
    assert _state(node, clock) == "ok"
    clock.advance(1.0)
    assert _state(node, clock) == "ok"  # exactly stale_after_s old: still fresh
    clock.advance(0.001)
    assert _state(node, clock) == "stale"
    assert node.snapshot(clock.now(), SETTINGS)["age_s"] == pytest.approx(1.001)


def test_slowness_alone_never_makes_a_node_stale() -> None:
    """Polls abandoned for hanging are failures that start no streak: the sample's age,
    not their number, ends freshness."""
    clock = ManualClock(100.0)
    node = _node(clock)
    for _ in range(10):
        node.fail(hard=False)
    assert _state(node, clock) == "ok"
    assert node.failures_total == 10 and node.consecutive_failures == 0
    clock.advance(1.5)
    assert _state(node, clock) == "stale"  # not dead: nothing failed hard


def test_hard_failures_end_freshness_before_the_age_does() -> None:
    clock = ManualClock(100.0)
    node = _node(clock)
    node.fail()
    node.fail()
    assert _state(node, clock) == "ok"
    node.fail()
    assert _state(node, clock) == "dead"
    assert node.accept(sample(clock), clock.now(), SETTINGS)  # it answers again
    assert _state(node, clock) == "ok" and node.consecutive_failures == 0


def test_tokens_flowing_keep_a_node_with_a_lagging_page_in_service() -> None:
    clock = ManualClock(100.0)
    node = _node(clock)
    clock.advance(0.5)
    node.progress(clock.now())
    clock.advance(0.9)  # sample 1.4 s old, tokens 0.9 s ago
    assert _state(node, clock) == "lagging"
    clock.advance(0.2)  # tokens 1.1 s ago: no evidence the engine serves
    assert _state(node, clock) == "stale"
    node.progress(clock.now())
    assert _state(node, clock) == "lagging"
    # A late sample (its GET sent 0.3 s ago) makes it fresh again.
    assert node.accept(sample(clock, at=clock.now() - 0.3), clock.now(), SETTINGS)
    assert _state(node, clock) == "ok"


def test_a_late_answer_is_a_sign_of_life() -> None:
    """A page that takes 1.5 s: its sample is already past stale_after_s when it arrives,
    yet the engine answered; lagging until stale_after_s after the answer."""
    clock = ManualClock(100.0)
    node = NodeState("a")
    assert node.accept(sample(clock, at=clock.now() - 1.5), clock.now(), SETTINGS)
    assert _state(node, clock) == "lagging"
    clock.advance(1.0)
    assert _state(node, clock) == "lagging"
    clock.advance(0.01)
    assert _state(node, clock) == "stale"
    assert node.snapshot(clock.now(), SETTINGS)["heard_age_s"] == pytest.approx(1.01)


def test_lagging_lasts_only_while_the_last_sample_is_young_enough() -> None:
    clock = ManualClock(100.0)
    node = _node(clock)
    limit = LAG_LIMIT_FACTOR * SETTINGS.stale_after_s
    for _ in range(int(limit / 0.5)):
        clock.advance(0.5)
        node.progress(clock.now())
        assert _state(node, clock) in ("ok", "lagging")
    assert clock.now() - 100.0 == pytest.approx(limit)
    assert _state(node, clock) == "lagging"
    clock.advance(0.01)
    node.progress(clock.now())
    assert _state(node, clock) == "stale"  # the books alone no longer stand in for it


def test_a_dead_page_on_an_engine_that_serves_is_lagging_then_dead() -> None:
    """The page errors (HTTP 500) while the gateway sees tokens: admission goes on from the
    last sample and the books; once the tokens stop, the node is dead."""
    clock = ManualClock(100.0)
    node = _node(clock)
    for _ in range(5):
        clock.advance(0.05)
        node.fail()
        node.progress(clock.now())
    assert _state(node, clock) == "lagging"
    clock.advance(1.01)
    assert _state(node, clock) == "dead"


def test_a_thrashing_node_is_thrashing_whether_fresh_or_lagging() -> None:
    clock = ManualClock(100.0)
    node = _node(clock, usage=0.93)
    clock.advance(0.05)
    thrash = sample(clock, usage=0.95, running=0, waiting=5)  # at panic: a victim requeued
    assert node.accept(thrash, clock.now(), SETTINGS)
    assert _state(node, clock) == "thrashing"
    clock.advance(1.5)
    node.progress(clock.now())
    assert _state(node, clock) == "thrashing"
    assert not node.usable(clock.now(), SETTINGS)


def test_snapshot_says_why() -> None:
    clock = ManualClock(100.0)
    node = _node(clock)
    node.fail(hard=False)
    clock.advance(0.4)
    node.progress(clock.now())
    clock.advance(1.0)
    snap = node.snapshot(clock.now(), SETTINGS)
    assert snap["state"] == "lagging" and snap["live"] and snap["usable"]
    assert not snap["fresh"]
    assert snap["age_s"] == pytest.approx(1.4)
    assert snap["progress_age_s"] == pytest.approx(1.0)
    assert snap["failures_total"] == 1 and snap["consecutive_failures"] == 0
    assert snap["sample"]["kv_usage"] == 0.1


# --- what admission does in each state (the adaptive policy) ------------------------------


def test_a_lagging_node_is_admitted_to_and_sheds_with_429_not_503() -> None:
    policy, clock = make(stale_after_s=1.0)
    policy.observe("a", sample(clock, usage=0.1, capacity=10_000))
    first = admit(policy, "r0", cost(100, 100), Priority.STANDARD, ("a",))
    assert isinstance(first, Admit)
    clock.advance(0.5)
    policy.on_first_token(first.ticket)
    # The page stops answering; the stream goes on.
    for i in range(1, 8):
        clock.advance(0.5)
        policy.on_tokens(first.ticket, i * 10)
        assert policy.snapshot()["nodes"]["a"]["state"] == ("ok" if i == 1 else "lagging")
        light = admit(policy, f"light{i}", cost(100, 100), Priority.STANDARD, ("a",))
        assert isinstance(light, Admit)  # served from the last sample plus the books
        policy.release(light.ticket, Outcome.DONE)
    # A burst the books say cannot fit is shed, as it would be on a fresh node.
    shed = 0
    admitted = []
    for i in range(40):
        decision = admit(policy, f"big{i}", cost(1000, 1000), Priority.STANDARD, ("a",))
        if isinstance(decision, Reject):
            assert decision.status == 429, decision
            shed += 1
        else:
            admitted.append(decision.ticket)
    assert shed and admitted
    for ticket in [first.ticket, *admitted]:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_without_tokens_a_silent_node_is_late_then_fails_closed() -> None:
    policy, clock = make(stale_after_s=1.0)
    policy.observe("a", sample(clock, usage=0.1))
    clock.advance(1.5)
    # Silent, but not for long and not failing: its page may only be late (a busy host).
    # Nothing goes to it; a request may wait for its next sample.
    late = admit(policy, "r", cost(), Priority.CRITICAL, ("a",))
    assert isinstance(late, Reject) and late.status == 429 and late.reason == "node_late"
    assert late.waitable
    node = policy.snapshot()["nodes"]["a"]
    assert node["state"] == "stale" and node["late"] and not node["usable"]
    clock.advance(LAG_LIMIT_FACTOR * 1.0)  # silent past the lag limit: lost
    refused = admit(policy, "r2", cost(), Priority.CRITICAL, ("a",))
    assert isinstance(refused, Reject)
    assert refused.status == 503 and refused.reason == "no_fresh_node"
    node = policy.snapshot()["nodes"]["a"]
    assert node["state"] == "stale" and not node["late"]


def test_a_node_failing_hard_is_not_late() -> None:
    policy, clock = make(stale_after_s=1.0)
    policy.observe("a", sample(clock, usage=0.1))
    for _ in range(policy.settings.tuning.failures_to_stale):
        policy.observe_failure("a", hard=True)
    clock.advance(1.5)
    refused = admit(policy, "r", cost(), Priority.CRITICAL, ("a",))
    assert isinstance(refused, Reject) and refused.status == 503, refused
    assert policy.snapshot()["nodes"]["a"]["state"] == "dead"


def test_a_lagging_node_at_high_kv_sheds_with_429() -> None:
    policy, clock = make(stale_after_s=1.0)
    policy.observe("a", sample(clock, usage=0.5, capacity=10_000))
    stream = admit(policy, "s", cost(10, 10), Priority.CRITICAL, ("a",))
    assert isinstance(stream, Admit)
    policy.observe("a", sample(clock, usage=0.97, capacity=10_000))
    clock.advance(2.0)
    policy.on_tokens(stream.ticket, 5)
    assert policy.snapshot()["nodes"]["a"]["state"] == "lagging"
    for priority in Priority:
        decision = admit(policy, f"r{priority.name}", cost(), priority, ("a",))
        assert isinstance(decision, Reject) and decision.status == 429, decision
    policy.release(stream.ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_soft_failures_reach_the_policy_without_ending_freshness() -> None:
    policy, clock = make(stale_after_s=1.0, failures_to_stale=3)
    policy.observe("a", sample(clock))
    for _ in range(5):
        policy.observe_failure("a", hard=False)
    decision = admit(policy, "r", cost(), Priority.STANDARD, ("a",))
    assert isinstance(decision, Admit)
    for _ in range(3):
        policy.observe_failure("a")
    assert policy.snapshot()["nodes"]["a"]["state"] == "dead"
    refused = admit(policy, "r2", cost(), Priority.STANDARD, ("a",))
    assert isinstance(refused, Reject) and refused.status == 503
    policy.release(decision.ticket, Outcome.DONE)
    assert_books_empty(policy)
