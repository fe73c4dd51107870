"""Deterministic tests of the adaptive policy on a ManualClock."""

from __future__ import annotations

import itertools
import random

from kvgate.core.admission import Admit, Outcome, Reject, Ticket
from kvgate.core.request import Priority

from .helpers import assert_books_empty, cost, make, sample

PANIC = 0.92
HIGH = 0.80


def admit(policy, request_id: str, c, priority=Priority.STANDARD, candidates=("a",)):
    return policy.admit(request_id, c, priority, list(candidates))


def test_burst_inside_one_scrape_period_never_passes_panic() -> None:
    policy, clock = make()
    for node in ("a", "b"):
        policy.observe(node, sample(clock, usage=0.5, capacity=20_000))
    admitted: list[Ticket] = []
    # 500 long critical requests arrive within the same instant: no new sample in between.
    for i in range(500):
        decision = admit(policy, f"r{i}", cost(3000, 1000), Priority.CRITICAL, ("a", "b"))
        if isinstance(decision, Admit):
            admitted.append(decision.ticket)
        for node in policy.snapshot()["nodes"].values():
            assert node["predicted_usage"] <= PANIC + 1e-12
    # 0.5 * 20000 = 10000 used; room to panic 8400 per node; each needs 4016 -> 2 per node.
    assert len(admitted) == 4
    last = admit(policy, "late", cost(3000, 1000), Priority.CRITICAL, ("a", "b"))
    assert isinstance(last, Reject) and last.status == 429 and last.reason == "kv_panic"
    for t in admitted:
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_burst_then_samples_catch_up_without_double_counting() -> None:
    """After prefill a sample contains the prompt; only the remaining growth stays reserved."""
    policy, clock = make(reflect_margin_s=0.0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    decision = admit(policy, "r", cost(2000, 1000), Priority.STANDARD)
    assert isinstance(decision, Admit)
    ticket = decision.ticket
    assert policy.snapshot()["nodes"]["a"]["reserved_tokens"] == 3016
    clock.advance(0.02)
    policy.on_first_token(ticket)
    policy.on_tokens(ticket, 1)
    clock.advance(0.03)
    policy.on_tokens(ticket, 10)
    # A sample taken now contains the prompt and the 10 tokens generated so far.
    policy.observe("a", sample(clock, usage=(2000 + 10) / 10_000, capacity=10_000))
    node = policy.snapshot()["nodes"]["a"]
    assert node["reserved_tokens"] == 1000 - 10 + 16
    assert abs(node["predicted_usage"] - (2010 + 1006) / 10_000) < 1e-9
    policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_sample_taken_before_first_token_reflects_nothing() -> None:
    policy, clock = make()  # default margin 0.05 s
    policy.observe("a", sample(clock, usage=0.0))
    decision = admit(policy, "r", cost(2000, 1000))
    assert isinstance(decision, Admit)
    clock.advance(0.01)
    policy.on_first_token(decision.ticket)
    clock.advance(0.02)
    # Sampled 0.02 s after the first token: within the margin, not trusted to contain it.
    policy.observe("a", sample(clock, usage=0.2))
    assert policy.snapshot()["nodes"]["a"]["reserved_tokens"] == 3016
    clock.advance(0.1)
    policy.observe("a", sample(clock, usage=0.2))
    assert policy.snapshot()["nodes"]["a"]["reserved_tokens"] == 1016
    policy.release(decision.ticket, Outcome.CLIENT_CANCEL)
    assert_books_empty(policy)


def test_hot_and_cold_node_routes_to_cold_without_averaging() -> None:
    policy, clock = make()
    policy.observe("hot", sample(clock, usage=0.99))
    policy.observe("cold", sample(clock, usage=0.10))
    # The sketch would see an average of 0.545 and send half of these to the hot node.
    for i in range(20):
        decision = admit(policy, f"r{i}", cost(100, 100), Priority.STANDARD, ("hot", "cold"))
        assert isinstance(decision, Admit) and decision.ticket.node_id == "cold"
    assert policy.snapshot()["nodes"]["hot"]["state"] == "panic"


def test_routes_to_most_headroom_and_fills_both() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.30))
    policy.observe("b", sample(clock, usage=0.10))
    placed = []
    for i in range(30):
        decision = admit(policy, f"r{i}", cost(100, 100), Priority.CRITICAL, ("a", "b"))
        assert isinstance(decision, Admit)
        placed.append(decision.ticket.node_id)
    # b first until it is as full as a, then both alternately.
    assert placed[:9] == ["b"] * 9
    assert "a" in placed[9:]
    usages = [n["predicted_usage"] for n in policy.snapshot()["nodes"].values()]
    assert abs(usages[0] - usages[1]) < 0.03


def test_power_of_two_choices_with_many_nodes_still_respects_fit() -> None:
    policy, clock = make(p2c_min_nodes=8)
    nodes = [f"n{i}" for i in range(16)]
    for i, node in enumerate(nodes):
        policy.observe(node, sample(clock, usage=0.95 if i % 2 else 0.1))
    for i in range(200):
        decision = admit(policy, f"r{i}", cost(50, 50), Priority.STANDARD, nodes)
        assert isinstance(decision, Admit)
        assert int(decision.ticket.node_id[1:]) % 2 == 0


def test_stale_node_takes_no_new_requests() -> None:
    policy, clock = make(stale_after_s=1.0)
    policy.observe("old", sample(clock, usage=0.0))
    clock.advance(0.5)
    policy.observe("new", sample(clock, usage=0.6))
    clock.advance(0.6)  # old: 1.1 s, new: 0.6 s
    for i in range(5):
        decision = admit(policy, f"r{i}", cost(), Priority.STANDARD, ("old", "new"))
        assert isinstance(decision, Admit) and decision.ticket.node_id == "new"
    snap = policy.snapshot()["nodes"]
    assert snap["old"]["state"] == "stale" and not snap["old"]["fresh"]
    assert abs(snap["old"]["age_s"] - 1.1) < 1e-9


def test_consecutive_scrape_failures_make_a_node_stale_at_once() -> None:
    policy, clock = make(failures_to_stale=3)
    policy.observe("a", sample(clock, usage=0.0))
    policy.observe("b", sample(clock, usage=0.5))
    for _ in range(3):
        policy.observe_failure("a")
    decision = admit(policy, "r", cost(), Priority.STANDARD, ("a", "b"))
    assert isinstance(decision, Admit) and decision.ticket.node_id == "b"
    policy.observe("a", sample(clock, usage=0.0))  # it answers again
    decision = admit(policy, "r2", cost(), Priority.STANDARD, ("a", "b"))
    assert isinstance(decision, Admit) and decision.ticket.node_id == "a"


def test_all_nodes_lost_fails_closed_with_503() -> None:
    policy, clock = make()
    policy.add_node("never")
    never = admit(policy, "r0", cost(), Priority.CRITICAL, ("never",))
    assert isinstance(never, Reject) and never.status == 503 and never.reason == "no_fresh_node"
    policy.observe("a", sample(clock))
    policy.observe("b", sample(clock))
    clock.advance(1.5)
    for i in range(50):
        decision = admit(policy, f"r{i}", cost(), Priority.CRITICAL, ("a", "b", "never"))
        assert isinstance(decision, Reject)
        assert decision.status == 503 and decision.reason == "no_fresh_node"
        assert 1.0 <= decision.retry_after_s <= 1.2
    assert policy.in_flight_requests == 0


def test_fail_open_sends_to_the_most_recently_heard_node() -> None:
    policy, clock = make(fail_mode="open")
    policy.observe("a", sample(clock))
    clock.advance(0.3)
    policy.observe("b", sample(clock))
    clock.advance(5.0)
    decision = admit(policy, "r", cost(), Priority.SHEDDABLE, ("a", "b"))
    assert isinstance(decision, Admit) and decision.ticket.node_id == "b"
    policy.release(decision.ticket, Outcome.UPSTREAM_ERROR)
    assert_books_empty(policy)


def test_thrashing_node_is_taken_out_of_rotation_for_a_while() -> None:
    policy, clock = make(thrash_hold_s=2.0)
    policy.observe("a", sample(clock, usage=0.85, running=8, waiting=1))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    clock.advance(0.05)
    # waiting rises while running falls at high usage: preemption.
    policy.observe("a", sample(clock, usage=0.86, running=5, waiting=4))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    assert policy.snapshot()["nodes"]["a"]["state"] == "thrashing"
    clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.10, running=1, waiting=0))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    decision = admit(policy, "r", cost(), Priority.CRITICAL, ("a", "b"))
    assert isinstance(decision, Admit) and decision.ticket.node_id == "b"
    only_a = admit(policy, "r2", cost(), Priority.CRITICAL, ("a",))
    assert isinstance(only_a, Reject) and only_a.reason == "thrashing"
    clock.advance(2.0)
    policy.observe("a", sample(clock, usage=0.10, running=1, waiting=0))
    assert policy.snapshot()["nodes"]["a"]["state"] == "ok"


def test_latency_far_above_baseline_with_a_queue_is_thrashing() -> None:
    policy, clock = make()
    for _ in range(40):
        policy.observe("a", sample(clock, usage=0.4, latency=0.02))
        clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.5, latency=0.2, waiting=0))
    assert policy.snapshot()["nodes"]["a"]["state"] == "ok"  # busy, nothing queued
    clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.5, latency=0.2, waiting=3))
    assert policy.snapshot()["nodes"]["a"]["state"] == "thrashing"


def _first_rejection_usage(priority: Priority) -> float:
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    for i in range(200):
        decision = admit(policy, f"r{i}", cost(50, 50), priority)
        if isinstance(decision, Reject):
            return policy.snapshot()["nodes"]["a"]["predicted_usage"]
    raise AssertionError("never rejected")


def test_priorities_are_shed_in_order_by_their_ceilings() -> None:
    sheddable = _first_rejection_usage(Priority.SHEDDABLE)
    standard = _first_rejection_usage(Priority.STANDARD)
    critical = _first_rejection_usage(Priority.CRITICAL)
    assert abs(sheddable - HIGH) < 0.011
    assert abs(standard - (HIGH + PANIC) / 2) < 0.011
    assert abs(critical - PANIC) < 0.011
    assert sheddable < standard < critical


def test_controller_sheds_sheddable_before_standard_and_never_critical() -> None:
    policy, clock = make()
    history = []
    # Reported usage stuck just above the high watermark (traffic kvgate does not see).
    for _ in range(80):
        policy.observe("a", sample(clock, usage=0.81, capacity=100_000))
        history.append(policy.snapshot()["controller"]["shed_probability"])
        clock.advance(0.05)
    for p in history:
        assert p["critical"] == 0.0
        assert p["sheddable"] >= p["standard"]
    assert history[-1]["sheddable"] == 1.0
    assert 0.3 < history[-1]["standard"] < 0.6
    sheddable_shed_at = next(i for i, p in enumerate(history) if p["sheddable"] > 0)
    standard_shed_at = next(i for i, p in enumerate(history) if p["standard"] > 0)
    assert sheddable_shed_at < standard_shed_at
    outcomes = {q: 0 for q in Priority}
    for i in range(300):
        for q in Priority:
            decision = admit(policy, f"{q}{i}", cost(10, 10), q)
            if isinstance(decision, Admit):
                outcomes[q] += 1
                policy.release(decision.ticket, Outcome.DONE)
    assert outcomes[Priority.CRITICAL] == 300
    assert outcomes[Priority.SHEDDABLE] == 0
    # About 1 - p_standard of the standard requests pass; seeded, so exactly reproducible.
    assert 100 < outcomes[Priority.STANDARD] < 220


def test_usage_held_above_target_ends_in_full_shedding_of_non_critical() -> None:
    policy, clock = make()
    for _ in range(60):
        policy.observe("a", sample(clock, usage=0.85, capacity=100_000))
        clock.advance(0.05)
    node = policy.snapshot()["nodes"]["a"]
    assert node["pressure"] == 1.0 and node["budget_tokens"] == 0.0
    standard = admit(policy, "s", cost(10, 10), Priority.STANDARD)
    assert isinstance(standard, Reject) and standard.status == 429
    critical = admit(policy, "c", cost(10, 10), Priority.CRITICAL)
    assert isinstance(critical, Admit)


def test_watermark_crossing_does_not_flap() -> None:
    """Usage creeping through the high watermark with noise: no 0<->100 % jumps."""
    policy, clock = make(seed=7)

    noise = random.Random(3)
    probabilities = []
    states = []
    for step in range(400):
        base = 0.70 + 0.20 * min(step, 200) / 200 - 0.20 * max(0, step - 200) / 200
        usage = base + noise.uniform(-0.01, 0.01)
        policy.observe("a", sample(clock, usage=usage, capacity=100_000))
        snap = policy.snapshot()
        probabilities.append(snap["controller"]["shed_probability"]["standard"])
        states.append(snap["nodes"]["a"]["state"])
        clock.advance(0.05)
    state_flips = sum(1 for x, y in itertools.pairwise(states) if x != y)
    # ok -> high -> panic -> high -> ok, plus at most a couple of noise-induced returns.
    assert state_flips <= 6
    jumps = [abs(y - x) for x, y in itertools.pairwise(probabilities)]
    assert max(jumps) < 0.35
    halves = [p >= 0.5 for p in probabilities]
    crossings = sum(1 for x, y in itertools.pairwise(halves) if x != y)
    assert crossings <= 4  # up once, down once, a little dither allowed


def test_tokens_generated_after_the_sample_are_not_assumed_reflected() -> None:
    """A page rendered before the latest tokens must not be credited with them."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    decision = admit(policy, "r", cost(1000, 1000))
    assert isinstance(decision, Admit)
    ticket = decision.ticket
    policy.on_first_token(ticket)
    clock.advance(0.2)
    policy.on_tokens(ticket, 100)
    sent_at = clock.now()  # the scrape leaves now; the gauge lags: it shows 1000 tokens
    clock.advance(0.01)
    policy.on_tokens(ticket, 150)
    clock.advance(0.01)
    policy.on_tokens(ticket, 200)
    policy.observe("a", sample(clock, usage=0.1, capacity=10_000, at=sent_at))
    predicted = policy.snapshot()["nodes"]["a"]["predicted_usage"] * 10_000
    assert predicted >= 1000 + 1000 - 1e-6  # the request's peak is never under-counted


def test_cached_refusal_is_dropped_when_room_appears_or_nodes_go_stale() -> None:
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=1000))
    first = admit(policy, "r1", cost(400, 400), Priority.CRITICAL)
    assert isinstance(first, Admit)
    for i in range(3):  # refused, the second and third time from the cached scan
        refused = admit(policy, f"x{i}", cost(400, 400), Priority.CRITICAL)
        assert isinstance(refused, Reject) and refused.reason == "kv_panic"
    small = admit(policy, "small", cost(50, 50), Priority.CRITICAL)
    assert isinstance(small, Admit)  # a smaller request still fits: the cache must not refuse
    policy.release(first.ticket, Outcome.DONE)
    again = admit(policy, "r2", cost(400, 400), Priority.CRITICAL)
    assert isinstance(again, Admit)
    refused = admit(policy, "r3", cost(400, 400), Priority.CRITICAL)
    assert isinstance(refused, Reject) and refused.status == 429
    clock.advance(1.01)  # no new sample: the node is stale now, a different answer
    stale = admit(policy, "r4", cost(400, 400), Priority.CRITICAL)
    assert isinstance(stale, Reject) and stale.status == 503 and stale.reason == "no_fresh_node"


def test_request_larger_than_any_node_is_a_503_no_capacity() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.0, capacity=4096))
    decision = admit(policy, "big", cost(2000, 4000), Priority.CRITICAL)
    assert isinstance(decision, Reject)
    assert (decision.status, decision.reason) == (503, "no_capacity")


def test_engine_without_kv_gauge_is_gated_by_its_queue() -> None:
    """llama.cpp: no KV gauge, no capacity: admit while nothing waits."""
    policy, clock = make()
    policy.observe("llama", sample(clock, usage=None, capacity=None, waiting=0))
    for i in range(5):
        assert isinstance(admit(policy, f"r{i}", cost(), candidates=("llama",)), Admit)
    policy.observe("llama", sample(clock, usage=None, capacity=None, running=4, waiting=2))
    refused = admit(policy, "q", cost(), candidates=("llama",))
    assert isinstance(refused, Reject) and refused.status == 429
    assert policy.snapshot()["nodes"]["llama"]["predicted_usage"] is None


def test_engine_without_kv_gauge_uses_configured_capacity_and_reservations() -> None:
    policy, clock = make(default_capacity_tokens=10_000, reservation_overhead_tokens=0)
    policy.observe("llama", sample(clock, usage=None, capacity=None))
    admitted = 0
    for i in range(50):
        decision = admit(policy, f"r{i}", cost(500, 500), Priority.CRITICAL, ("llama",))
        if isinstance(decision, Admit):
            admitted += 1
            decision.ticket.first_token_at = clock.now()  # nothing is ever "reflected"
    clock.advance(0.2)
    policy.observe("llama", sample(clock, usage=None, capacity=None))
    assert admitted == 9  # 9 x 1000 <= 0.92 x 10000
    assert policy.snapshot()["nodes"]["llama"]["predicted_usage"] == 0.9


def test_lowered_budget_is_reported_as_the_reason() -> None:
    policy, clock = make(reservation_overhead_tokens=0)
    for _ in range(60):  # sustained 0.83: the controller lowers the ceiling towards 0.80
        policy.observe("a", sample(clock, usage=0.83, capacity=100_000))
        clock.advance(0.05)
    reasons = set()
    for i in range(50):
        decision = admit(policy, f"r{i}", cost(10, 10), Priority.STANDARD)
        assert isinstance(decision, Reject)
        reasons.add(decision.reason)
    # Under the static standard ceiling (0.86) it would fit: the budget refused it,
    # unless the shedding draw did first.
    assert reasons <= {"budget", "kv_high_watermark"} and "budget" in reasons


def test_a_refusal_names_panic_only_when_every_node_is_there() -> None:
    """One hot node beside a calm one is a routing matter: the refusal of a request too big
    for the calm node's room says so, instead of blaming a panic the cluster is not in."""
    policy, clock = make()
    policy.observe("hot", sample(clock, usage=0.99))
    policy.observe("calm", sample(clock, usage=0.45))
    too_big = admit(policy, "big", cost(3_500, 1_000), Priority.STANDARD, ("hot", "calm"))
    assert isinstance(too_big, Reject) and too_big.reason != "kv_panic"
    policy.observe("calm", sample(clock, usage=0.99))
    clock.advance(0.05)
    at_panic = admit(policy, "big2", cost(3_500, 1_000), Priority.STANDARD, ("hot", "calm"))
    assert isinstance(at_panic, Reject) and at_panic.reason == "kv_panic"
