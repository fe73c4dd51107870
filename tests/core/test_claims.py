"""Large requests: spread retries (on by default) and claims (opt-in) against starvation."""

from __future__ import annotations

from kvgate.core.admission import Admit, Outcome, Reject, Ticket
from kvgate.core.request import Priority

from .helpers import assert_books_empty, cost, make, sample

CAP = 10_000
PANIC = 0.92


def _chat_stream(policy, clock, held: list[Ticket], step: int, chats: int = 4) -> None:
    """Finish the oldest chat, then offer `chats` new ones (each 500 tokens)."""
    if held:
        policy.release(held.pop(0), Outcome.DONE)
    for k in range(chats):
        decision = policy.admit(f"c{step}-{k}", cost(250, 250), Priority.STANDARD, ["a"])
        if isinstance(decision, Admit):
            held.append(decision.ticket)
    clock.advance(0.25)
    policy.observe("a", sample(clock, usage=0.0, capacity=CAP))


def _long_until_admitted(claims: bool, retries: int = 40) -> tuple[int | None, object]:
    """A 4,000-token request retries every 0.5 s against a steady stream of 500-token chats."""
    policy, clock = make(reservation_overhead_tokens=0, claims=claims, claim_lead_s=60.0)
    policy.observe("a", sample(clock, usage=0.0, capacity=CAP))
    held: list[Ticket] = []
    for step in range(20):  # the chats fill the node first
        _chat_stream(policy, clock, held, step)
    admitted_at = None
    for attempt in range(retries):
        decision = policy.admit(f"long#{attempt}", cost(3000, 1000), Priority.STANDARD, ["a"])
        if isinstance(decision, Admit):
            admitted_at = attempt
            held.append(decision.ticket)
            break
        assert decision.reason != "claimed"  # the large request is never blocked by its claim
        for half in range(2):
            _chat_stream(policy, clock, held, 100 + 2 * attempt + half)
    for ticket in held:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)
    return admitted_at, policy


def test_large_request_gets_in_within_bounded_retries() -> None:
    without, _ = _long_until_admitted(claims=False)
    with_claims, _ = _long_until_admitted(claims=True)
    assert without is None  # the chats take every freed token: starvation
    # Room freed by one finishing chat per step accumulates: 4,000 tokens in <= 8 steps.
    assert with_claims is not None and with_claims <= 5


def test_claim_shows_in_snapshot_and_expires() -> None:
    policy, clock = make(
        reservation_overhead_tokens=0, claims=True, claim_lead_s=60.0, claim_grace_s=1.0
    )
    policy.observe("a", sample(clock, usage=0.6, capacity=CAP))
    refused = policy.admit("long", cost(3000, 1000), Priority.STANDARD, ["a"])
    assert isinstance(refused, Reject) and refused.status == 429
    node = policy.snapshot()["nodes"]["a"]
    assert node["claimed_tokens"] == 4000
    assert 0 < node["claim_expires_in_s"] <= refused.retry_after_s + 1.0 + 1e-9
    # A chat that fits under the ceiling but only in the claimed room is refused.
    policy.observe("a", sample(clock, usage=0.5, capacity=CAP))
    chat = policy.admit("chat", cost(200, 200), Priority.STANDARD, ["a"])
    assert isinstance(chat, Reject) and chat.reason == "claimed"
    clock.advance(refused.retry_after_s + 1.0 + 0.01)
    policy.observe("a", sample(clock, usage=0.5, capacity=CAP))
    assert policy.snapshot()["nodes"]["a"]["claimed_tokens"] == 0
    chat = policy.admit("chat2", cost(200, 200), Priority.STANDARD, ["a"])
    assert isinstance(chat, Admit)  # expired: the room is anyone's again
    policy.release(chat.ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_claim_is_used_by_a_large_request_and_ends() -> None:
    policy, clock = make(reservation_overhead_tokens=0, claims=True, claim_lead_s=60.0)
    policy.observe("a", sample(clock, usage=0.6, capacity=CAP))
    assert isinstance(policy.admit("l1", cost(3000, 1000), Priority.STANDARD, ["a"]), Reject)
    policy.observe("a", sample(clock, usage=0.3, capacity=CAP))
    # 3,300 >= 0.8 x 4,000: the same size class may use the claimed room.
    other = policy.admit("l2", cost(2800, 500), Priority.STANDARD, ["a"])
    assert isinstance(other, Admit)
    assert policy.snapshot()["nodes"]["a"]["claimed_tokens"] == 0
    policy.release(other.ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_claims_do_not_bind_more_important_requests_or_pass_panic() -> None:
    policy, clock = make(reservation_overhead_tokens=0, claims=True, claim_lead_s=60.0)
    policy.observe("a", sample(clock, usage=0.6, capacity=CAP))
    assert isinstance(policy.admit("l", cost(3000, 1000), Priority.SHEDDABLE, ["a"]), Reject)
    assert policy.snapshot()["nodes"]["a"]["claimed_tokens"] == 4000
    held = []
    for i in range(100):  # critical work ignores a sheddable claim, but never passes panic
        decision = policy.admit(f"c{i}", cost(100, 100), Priority.CRITICAL, ["a"])
        if isinstance(decision, Admit):
            held.append(decision.ticket)
        usage = policy.snapshot()["nodes"]["a"]["predicted_usage"]
        assert usage <= PANIC + 1e-12
    assert len(held) == 16  # (0.92 - 0.6) x 10,000 / 200
    for ticket in held:
        policy.release(ticket, Outcome.DONE)
    assert_books_empty(policy)


def test_no_claim_for_a_node_at_panic_or_when_disabled() -> None:
    policy, clock = make(reservation_overhead_tokens=0, claims=True)
    policy.observe("a", sample(clock, usage=0.95, capacity=CAP))
    assert isinstance(policy.admit("l", cost(3000, 1000), Priority.STANDARD, ["a"]), Reject)
    assert policy.snapshot()["nodes"]["a"]["claimed_tokens"] == 0
    off, clock = make(reservation_overhead_tokens=0)  # claims are off by default
    off.observe("a", sample(clock, usage=0.6, capacity=CAP))
    assert isinstance(off.admit("l", cost(3000, 1000), Priority.STANDARD, ["a"]), Reject)
    assert off.snapshot()["nodes"]["a"]["claimed_tokens"] == 0


def _burst_retry_afters(spread: bool) -> list[float]:
    """Ten large requests refused at once, after the node has been freeing ~1,500 tok/s."""
    policy, clock = make(reservation_overhead_tokens=0, large_retry_spread=spread)
    policy.observe("a", sample(clock, usage=0.0, capacity=CAP))
    for i in range(40):  # 40 x 500 tokens released over 10 s: a measured freeing rate
        decision = policy.admit(f"w{i}", cost(250, 250), Priority.STANDARD, ["a"])
        assert isinstance(decision, Admit)
        clock.advance(0.25)
        policy.release(decision.ticket, Outcome.DONE)
        policy.observe("a", sample(clock, usage=0.0, capacity=CAP))
    policy.observe("a", sample(clock, usage=0.5, capacity=CAP))
    delays = []
    for i in range(10):
        decision = policy.admit(f"l{i}", cost(3000, 1000), Priority.STANDARD, ["a"])
        assert isinstance(decision, Reject) and decision.status == 429
        delays.append(decision.retry_after_s)
    assert_books_empty(policy)
    return delays


def test_a_burst_of_large_requests_is_told_to_come_back_at_different_times() -> None:
    plain = _burst_retry_afters(spread=False)
    spread = _burst_retry_afters(spread=True)
    assert max(plain) <= 1.2  # all of them would come back together, within a second
    # Ten waiters of 4,000 tokens at ~1,500 tok/s freed: the draws reach well past that.
    assert max(spread) >= 5.0
    assert len({round(d, 1) for d in spread}) >= 6
    assert all(1.0 <= d <= 30.0 for d in spread)
