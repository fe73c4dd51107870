"""Deterministic tests of the adaptive policy on a ManualClock."""

from __future__ import annotations

import itertools
import random

from kvgate.core.admission import Admit, Outcome, Reject, Ticket
from kvgate.core.nodes import LAG_LIMIT_FACTOR
from kvgate.core.request import Priority
from kvgate.testing.books import upper_tokens

from .helpers import admit, assert_books_empty, cost, make, sample

PANIC = 0.92
HIGH = 0.80


def _peak(policy, node_id: str) -> float:  # type: ignore[no-untyped-def]
    return policy.snapshot()["nodes"][node_id]["peak_usage"]


def test_burst_inside_one_scrape_period_never_plans_past_panic() -> None:
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
            assert node["peak_usage"] <= PANIC + 1e-12
    # 0.5 * 20000 = 10000 used; room to panic 8400 per node; each needs 4016 -> 2 per node.
    assert len(admitted) == 4
    last = admit(policy, "late", cost(3000, 1000), Priority.CRITICAL, ("a", "b"))
    assert isinstance(last, Reject) and last.status == 429 and last.waitable
    # The nodes hold 0.8 now (their peak will be 0.9): full for this request, not at panic.
    assert last.reason == "kv_planned_peak"
    for t in admitted:
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_burst_then_samples_catch_up_without_double_counting() -> None:
    """After prefill a sample contains the prompt; only the remaining growth stays held."""
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
    assert upper_tokens(policy, policy.nodes["a"]) == 2010 + 1006
    # What it holds now: the sample plus the block rounding, nothing counted twice.
    assert abs(node["predicted_usage"] - (2010 + 16) / 10_000) < 1e-9
    policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_sample_taken_before_first_token_reflects_nothing() -> None:
    policy, clock = make()  # default margin 0.1 s
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
        policy.on_first_token(decision.ticket)  # prefilled: no prompt queued on either node
        placed.append(decision.ticket.node_id)
    # b first until it is as full as a, then both alternately.
    assert placed[:9] == ["b"] * 9
    assert "a" in placed[9:]
    bounds = [upper_tokens(policy, policy.nodes[n]) for n in ("a", "b")]
    assert abs(bounds[0] - bounds[1]) <= 216  # within one request of each other


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
    # Only late (heard 1.5 s ago, no hard failure): the request may wait for a sample, and
    # goes nowhere meanwhile; one that cannot wait retries after about stale_after_s.
    late = admit(policy, "late", cost(), Priority.CRITICAL, ("a", "b", "never"))
    assert isinstance(late, Reject) and late.status == 429 and late.reason == "node_late"
    assert late.waitable and 1.0 <= late.retry_after_s <= 1.2
    clock.advance(LAG_LIMIT_FACTOR * policy.settings.stale_after_s)  # past the lag limit
    for i in range(50):
        decision = admit(policy, f"r{i}", cost(), Priority.CRITICAL, ("a", "b", "never"))
        assert isinstance(decision, Reject)
        assert decision.status == 503 and decision.reason == "no_fresh_node"
        assert not decision.waitable
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
    policy.observe("a", sample(clock, usage=0.93, running=8, waiting=1))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    clock.advance(0.05)
    # waiting rises while running falls with the cache full: preemption.
    policy.observe("a", sample(clock, usage=0.94, running=5, waiting=4))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    assert policy.snapshot()["nodes"]["a"]["state"] == "thrashing"
    clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.10, running=1, waiting=0))
    policy.observe("b", sample(clock, usage=0.30, running=8, waiting=0))
    decision = admit(policy, "r", cost(), Priority.CRITICAL, ("a", "b"))
    assert isinstance(decision, Admit) and decision.ticket.node_id == "b"
    only_a = admit(policy, "r2", cost(), Priority.CRITICAL, ("a",))
    assert isinstance(only_a, Reject) and only_a.reason == "thrashing" and only_a.waitable
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


def _first_refusal_peak(priority: Priority) -> float:
    """The node's planned peak when the first request of `priority` no longer fits."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    for i in range(200):
        decision = admit(policy, f"r{i}", cost(50, 50), priority)
        if isinstance(decision, Reject):
            return _peak(policy, "a")
    raise AssertionError("never refused")


def test_priorities_fill_a_node_up_to_their_ceilings() -> None:
    """Sheddable work stops at the high watermark, leaving the rest for interactive work to
    start at once; standard and critical work may plan a peak up to panic."""
    sheddable = _first_refusal_peak(Priority.SHEDDABLE)
    standard = _first_refusal_peak(Priority.STANDARD)
    critical = _first_refusal_peak(Priority.CRITICAL)
    assert HIGH - 0.011 < sheddable <= HIGH
    assert PANIC - 0.011 < standard <= PANIC
    assert PANIC - 0.011 < critical <= PANIC


def _overshoot(policy, clock, usage: float = 0.97, samples: int = 10) -> None:  # type: ignore[no-untyped-def]
    """The engine measures more than was planned (traffic kvgate does not see), then less."""
    for _ in range(samples):
        policy.observe("a", sample(clock, usage=usage, capacity=100_000))
        clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.30, capacity=100_000))


def test_an_overshoot_lowers_the_ceilings_of_non_critical_work_never_critical() -> None:
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.30, capacity=100_000))
    assert policy.snapshot()["nodes"]["a"]["margin"] == 0.0  # the plan holds: no margin
    _overshoot(policy, clock)
    margin = policy.snapshot()["nodes"]["a"]["margin"]
    assert policy.snapshot()["controller"]["margins"]["a"] == margin
    assert 0.03 < margin <= PANIC - HIGH
    node = policy.nodes["a"]
    assert policy.ceiling(node, Priority.CRITICAL) == PANIC
    assert abs(policy.ceiling(node, Priority.STANDARD) - (PANIC - margin)) < 1e-12
    assert abs(policy.ceiling(node, Priority.SHEDDABLE) - (HIGH - margin)) < 1e-12
    # A standard request that fits under the static ceiling waits under the lowered one.
    held: list[Ticket] = []
    while True:
        decision = admit(policy, f"c{len(held)}", cost(5000, 5000), Priority.CRITICAL)
        assert isinstance(decision, Admit)
        held.append(decision.ticket)
        if (PANIC - margin) * 100_000 < upper_tokens(policy, node) + 1000 <= PANIC * 100_000:
            break
    standard = admit(policy, "s", cost(500, 500), Priority.STANDARD)
    assert isinstance(standard, Reject) and standard.waitable
    critical = admit(policy, "c", cost(500, 500), Priority.CRITICAL)
    assert isinstance(critical, Admit)
    for ticket in [*held, critical.ticket]:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_the_margin_fades_once_the_overshoot_is_gone() -> None:
    policy, clock = make()
    _overshoot(policy, clock)
    margins = []
    for _ in range(1200):  # a minute of usage back at 0.30
        clock.advance(0.05)
        policy.observe("a", sample(clock, usage=0.30, capacity=100_000))
        margins.append(policy.snapshot()["nodes"]["a"]["margin"])
    assert all(y <= x for x, y in itertools.pairwise(margins))  # only ever down
    assert margins[199] < margins[0] * 0.3  # about two half-lives (10 s) in
    assert margins[-1] == 0.0
    assert policy.ceiling(policy.nodes["a"], Priority.STANDARD) == PANIC


def test_a_node_measured_at_panic_takes_nothing_new_critical_included() -> None:
    policy, clock = make()
    for _ in range(60):
        policy.observe("a", sample(clock, usage=0.93, capacity=100_000))
        clock.advance(0.05)
    for priority in Priority:
        refused = admit(policy, f"{priority.label}", cost(10, 10), priority)
        assert isinstance(refused, Reject) and refused.status == 429
        assert refused.reason == "kv_panic" and refused.waitable
    # Back below panic by more than the hysteresis: critical work starts again at once.
    policy.observe("a", sample(clock, usage=0.85, capacity=100_000))
    critical = admit(policy, "c", cost(10, 10), Priority.CRITICAL)
    assert isinstance(critical, Admit)
    policy.release(critical.ticket, Outcome.DONE)


def test_watermark_crossing_does_not_flap() -> None:
    """Usage creeping through the watermarks with noise: the node's level and its margin
    move smoothly, no 0 <-> full jumps."""
    policy, clock = make(seed=7)

    noise = random.Random(3)
    margins = []
    states = []
    for step in range(400):
        base = 0.75 + 0.22 * min(step, 200) / 200 - 0.22 * max(0, step - 200) / 200
        usage = base + noise.uniform(-0.01, 0.01)
        policy.observe("a", sample(clock, usage=usage, capacity=100_000))
        snap = policy.snapshot()
        margins.append(snap["nodes"]["a"]["margin"])
        states.append(snap["nodes"]["a"]["state"])
        clock.advance(0.05)
    state_flips = sum(1 for x, y in itertools.pairwise(states) if x != y)
    # ok -> high -> panic -> high -> ok, plus at most a couple of noise-induced returns.
    assert state_flips <= 6
    assert max(margins) > 0.03  # it did overshoot panic
    jumps = [abs(y - x) for x, y in itertools.pairwise(margins)]
    assert max(jumps) < 0.03


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
    node = policy.nodes["a"]
    assert upper_tokens(policy, node) >= 1000 + 1000 - 1e-6  # its peak is never under-counted
    assert policy.forecast.now_tokens(node) >= 1000 + 200 - 1e-6  # nor what it holds now


def test_stream_events_past_max_tokens_never_lift_what_it_holds_past_its_bound() -> None:
    """A stream relays a few more SSE events than tokens (the role and finish chunks, a
    usage chunk): the count reported past `max_tokens` holds no KV, so the bound that the
    fast path of admission trusts stays an upper bound of what the node holds."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.2, capacity=10_000))
    first = admit(policy, "r", cost(3000, 10), Priority.CRITICAL)
    assert isinstance(first, Admit)
    policy.on_first_token(first.ticket)
    policy.on_tokens(first.ticket, 13)  # 10 tokens and 3 framing events
    node = policy.nodes["a"]
    upper = upper_tokens(policy, node)
    now = policy.forecast.now_tokens(node)
    assert upper is not None and now is not None and now <= upper
    filler = admit(policy, "f", cost(int(PANIC * 10_000 - upper) - 10, 10), Priority.CRITICAL)
    assert isinstance(filler, Admit)  # exactly up to the ceiling on the bound
    assert _peak(policy, "a") <= PANIC + 1e-12
    clock.advance(0.5)
    policy.on_tokens(first.ticket, 14)  # no KV, but it shows the engine serving
    assert policy.nodes["a"].progress_at == clock.now()
    for ticket in (first.ticket, filler.ticket):
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_a_new_sample_moves_the_planned_peak_of_a_node_without_requests() -> None:
    """The envelope's base is the sample's `used`: a node on which this gateway runs
    nothing must not be planned from the usage an earlier sample showed."""
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.10, capacity=100_000))
    assert _peak(policy, "a") == 0.10  # the snapshot plans the node's peak (and keeps it)
    clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.85, capacity=100_000))  # traffic it cannot see
    assert _peak(policy, "a") == 0.85
    refused = admit(policy, "s", cost(2500, 2500), Priority.SHEDDABLE)
    assert isinstance(refused, Reject) and refused.reason == "kv_planned_peak"


def test_a_node_whose_requests_all_ended_is_planned_from_its_new_requests() -> None:
    """When the last request on a node ends and new ones come, the node's planned peak is
    theirs, not the one planned before (its books start again)."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    small = admit(policy, "small", cost(100, 100), Priority.CRITICAL)
    assert isinstance(small, Admit)
    assert _peak(policy, "a") == 0.02
    policy.release(small.ticket, Outcome.CLIENT_CANCEL)
    big = admit(policy, "big", cost(4000, 4000), Priority.CRITICAL)
    assert isinstance(big, Admit)
    assert _peak(policy, "a") == 0.8
    # 4,000 + 4,000 held now and growing for 1,000 steps: 10,000 at the peak, past panic.
    refused = admit(policy, "next", cost(4000, 1000), Priority.CRITICAL)
    assert isinstance(refused, Reject) and refused.waitable
    policy.release(big.ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_a_request_that_outlives_its_expected_length_is_planned_to_its_cap() -> None:
    """Past its learned length a request is expected to run to `max_tokens`: the node's
    planned peak says so as soon as its count does, not at the next sample."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=10_000))
    for i in range(16):  # the model's requests end after 10 tokens
        learned = admit(policy, f"l{i}", cost(10, 1000), Priority.CRITICAL, model="m")
        assert isinstance(learned, Admit)
        policy.on_tokens(learned.ticket, 10)
        policy.release(learned.ticket, Outcome.DONE)
    long = admit(policy, "long", cost(1000, 1000), Priority.CRITICAL, model="m")
    assert isinstance(long, Admit) and long.ticket.expected_output == 10
    assert _peak(policy, "a") == 0.101  # its prompt and 10 tokens, then it frees
    policy.on_tokens(long.ticket, 11)  # past its expected length: it may run to 1,000
    assert _peak(policy, "a") == 0.2
    # 6,500 + 1,000 beside it would peak at 9,521 tokens, past panic (9,200).
    refused = admit(policy, "big", cost(6500, 1000), Priority.CRITICAL)
    assert isinstance(refused, Reject) and refused.waitable
    policy.release(long.ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_refused_until_room_appears_and_a_503_once_the_node_is_stale() -> None:
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("a", sample(clock, usage=0.0, capacity=1000))
    first = admit(policy, "r1", cost(400, 400), Priority.CRITICAL)
    assert isinstance(first, Admit)
    for i in range(3):
        refused = admit(policy, f"x{i}", cost(400, 400), Priority.CRITICAL)
        assert isinstance(refused, Reject) and refused.reason == "kv_planned_peak"
        assert refused.waitable
    small = admit(policy, "small", cost(50, 50), Priority.CRITICAL)
    assert isinstance(small, Admit)  # a smaller request still fits
    policy.release(first.ticket, Outcome.DONE)
    again = admit(policy, "r2", cost(400, 400), Priority.CRITICAL)
    assert isinstance(again, Admit)
    refused = admit(policy, "r3", cost(400, 400), Priority.CRITICAL)
    assert isinstance(refused, Reject) and refused.status == 429
    clock.advance(1.01)  # no new sample: the node is late now, a different answer
    late = admit(policy, "r4", cost(400, 400), Priority.CRITICAL)
    assert isinstance(late, Reject) and late.reason == "node_late" and late.waitable
    clock.advance(LAG_LIMIT_FACTOR * policy.settings.stale_after_s)  # past the lag limit
    stale = admit(policy, "r5", cost(400, 400), Priority.CRITICAL)
    assert isinstance(stale, Reject) and stale.status == 503 and stale.reason == "no_fresh_node"


def test_request_larger_than_any_node_is_a_400_no_capacity() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.0, capacity=4096))
    decision = admit(policy, "big", cost(2000, 4000), Priority.CRITICAL)
    assert isinstance(decision, Reject)
    assert (decision.status, decision.reason) == (400, "no_capacity")
    assert not decision.waitable and "Shorten the prompt" in decision.message


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


def test_engine_without_kv_gauge_uses_its_configured_capacity_and_holds() -> None:
    """No KV gauge but a capacity (the backend's `kv_capacity_tokens`): the node's usage is
    the sum of its holds, since no sample ever reflects any of them."""
    policy, clock = make(reservation_overhead_tokens=0)
    policy.observe("llama", sample(clock, usage=None, capacity=10_000))
    tickets = []
    for i in range(50):
        decision = admit(policy, f"r{i}", cost(500, 500), Priority.CRITICAL, ("llama",))
        if isinstance(decision, Admit):
            tickets.append(decision.ticket)
            policy.on_first_token(decision.ticket)
    clock.advance(0.2)
    policy.observe("llama", sample(clock, usage=None, capacity=10_000))
    assert len(tickets) == 9  # 9 x 1000 <= 0.92 x 10000
    node = policy.nodes["llama"]
    assert upper_tokens(policy, node) == 9000  # nothing reflected
    assert policy.snapshot()["nodes"]["llama"]["predicted_usage"] == 0.45  # the prompts
    for ticket in tickets:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_a_refusal_names_panic_only_when_every_node_is_there() -> None:
    """One hot node beside a calm one is a routing matter: the refusal of a request too big
    for the calm node's room says so, instead of blaming a panic the cluster is not in."""
    policy, clock = make()
    policy.observe("hot", sample(clock, usage=0.99))
    policy.observe("calm", sample(clock, usage=0.45))
    too_big = admit(policy, "big", cost(4_000, 1_000), Priority.STANDARD, ("hot", "calm"))
    assert isinstance(too_big, Reject) and too_big.reason == "kv_planned_peak"
    policy.observe("calm", sample(clock, usage=0.99))
    clock.advance(0.05)
    at_panic = admit(policy, "big2", cost(4_000, 1_000), Priority.STANDARD, ("hot", "calm"))
    assert isinstance(at_panic, Reject) and at_panic.reason == "kv_panic"
