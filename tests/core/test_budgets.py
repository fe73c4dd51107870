"""A tenant's budgets on one replica, in virtual time: the bucket's arithmetic, reservations
settled with what was used (refunds, charges beyond), waits for the refill and refusals
whose Retry-After is the refill time."""

from __future__ import annotations

import pytest

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.budgets import BudgetLimits, Budgets
from kvgate.core.budgets.bucket import TOKENS_PER_MINUTE, Bucket
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.request import RequestCost

from .helpers import cost, make, request, sample

PER_MINUTE = 600  # tokens per minute: 10 a second


def flow(limits: BudgetLimits, **queue: float) -> tuple[FlowController, ManualClock]:
    """A flow controller whose tenant `t` has `limits`, one roomy node, fresh samples."""
    policy, clock = make()
    budgets = Budgets(limits={"t": limits})
    controller = FlowController(policy, budgets=budgets)
    if queue:
        controller.queue_settings.max_wait_s.update(queue)
    controller.add_node("a")
    controller.observe("a", sample(clock, usage=0.0, capacity=100_000))
    return controller, clock


def submit(controller: FlowController, rid: str, c: RequestCost, **fields: object):  # type: ignore[no-untyped-def]
    return controller.submit(request(rid, c, tenant="t", exact_output=True, **fields))


def tick(controller: FlowController, clock: ManualClock, seconds: float) -> None:
    """Let `seconds` pass; the node's fresh sample wakes the waiters."""
    clock.advance(seconds)
    controller.observe("a", sample(clock, usage=0.0, capacity=100_000))
    controller.dispatch()


def ticket_of(decision: object):  # type: ignore[no-untyped-def]
    assert isinstance(decision, Admit), decision
    return decision.ticket


# ---- the bucket -----------------------------------------------------------------------------


def test_the_bucket_refills_continuously_up_to_one_window() -> None:
    bucket = Bucket(PER_MINUTE, 60.0, now=0.0)
    assert bucket.free(0.0) == PER_MINUTE
    bucket.reserve(600)
    assert bucket.free(0.0) == 0
    bucket.settle(600, 600)
    assert bucket.level == 0
    assert bucket.free(15.0) == pytest.approx(150)  # 10 tokens a second
    assert bucket.free(600.0) == PER_MINUTE  # never more than one window's budget


def test_a_settle_refunds_what_was_not_used_and_charges_what_was_used_beyond() -> None:
    bucket = Bucket(PER_MINUTE, 60.0, now=0.0)
    bucket.reserve(500)
    bucket.settle(500, 120)  # the stream ended early: 380 back
    assert bucket.free(0.0) == pytest.approx(480) and bucket.reserved == 0
    bucket.reserve(480)
    bucket.settle(480, 700)  # the engine counted more than was reserved
    assert bucket.level == pytest.approx(-220)  # below zero by what was really spent
    assert bucket.consumed == 820
    # The refill makes it good: 220 + a request of 100 need 32 s at 10 a second.
    assert bucket.wait(100, 0.0, 0.0) == pytest.approx(32.0)
    assert bucket.reset_s(0.0) == pytest.approx(60.0)  # full again after a whole window


def test_a_wait_counts_what_is_waiting_before() -> None:
    bucket = Bucket(PER_MINUTE, 60.0, now=0.0)
    bucket.reserve(550)
    assert bucket.wait(50, 0.0, 0.0) == 0.0
    assert bucket.wait(100, 0.0, 0.0) == pytest.approx(5.0)
    assert bucket.wait(100, 200, 0.0) == pytest.approx(25.0)


# ---- one replica's flow controller ----------------------------------------------------------


def test_requests_within_the_budget_start_and_a_settle_returns_the_unused_part() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    first = ticket_of(submit(controller, "a", cost(100, 200)))
    status = controller.budgets.status("t", clock.now())["tokens"]
    assert status.limit == PER_MINUTE and status.remaining == 300
    assert status.reset_s == pytest.approx(30.0)
    first.output_tokens = 50  # it ended after 50 of its 200 tokens
    controller.release(first, Outcome.CLIENT_CANCEL)  # settled by what it produced
    assert controller.budgets.status("t", clock.now())["tokens"].remaining == 450
    controller.release(first, Outcome.CLIENT_CANCEL)  # exactly once
    snap = controller.snapshot()["budgets"]["t"]["windows"]["tokens_per_minute"]
    assert snap["spent"] == 150 and snap["reserved"] == 0 and snap["remaining"] == 450


def test_a_request_that_does_not_fit_waits_for_the_refill_and_starts_when_it_comes() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    controller.release(ticket_of(submit(controller, "a", cost(100, 400))), Outcome.DONE, 500)
    waiter = submit(controller, "b", cost(100, 100))  # 200 needed, 100 left: 10 s of refill
    assert isinstance(waiter, Waiter)
    later = submit(controller, "c", cost(10, 10))  # it would fit, but waits behind "b"
    assert isinstance(later, Waiter)
    tick(controller, clock, 9.0)
    assert waiter.waiting and later.waiting
    tick(controller, clock, 1.0)
    assert isinstance(waiter.decision, Admit)
    tick(controller, clock, 2.0)
    assert isinstance(later.decision, Admit)  # 20 more tokens of refill: its turn


def test_the_bucket_refills_while_requests_run_and_a_refund_stops_at_a_full_bucket() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    running = ticket_of(submit(controller, "a", cost(100, 500)))
    tick(controller, clock, 30.0)
    assert controller.budgets.status("t", clock.now())["tokens"].remaining == 300
    tick(controller, clock, 40.0)
    assert controller.budgets.status("t", clock.now())["tokens"].remaining == PER_MINUTE
    controller.release(running, Outcome.DONE, used_tokens=200)  # 400 back: the bucket is full
    assert controller.budgets.status("t", clock.now())["tokens"].remaining == PER_MINUTE
    snap = controller.snapshot()["budgets"]["t"]["windows"]["tokens_per_minute"]
    assert snap["spent"] == 200 and snap["level"] == PER_MINUTE


def test_a_request_whose_refill_is_beyond_its_bound_is_told_the_refill_time() -> None:
    controller, _ = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    ticket_of(submit(controller, "a", cost(100, 450)))  # 50 left
    refused = submit(controller, "b", cost(100, 150), max_wait_s=5.0)  # needs 20 s of refill
    assert isinstance(refused, Reject)
    assert refused.status == 429 and refused.reason == "tenant_budget"
    assert 20.0 <= refused.retry_after_s <= 20.0 * 1.05
    assert "budget of 600 tokens per minute" in refused.message
    # Behind a waiter, the wait is the refill for both.
    waiting = submit(controller, "c", cost(50, 50))  # 5 s of refill
    assert isinstance(waiting, Waiter)
    refused = submit(controller, "d", cost(100, 100), max_wait_s=15.0)  # 25 s, after "c"
    assert isinstance(refused, Reject) and refused.reason == "tenant_budget"
    assert 25.0 <= refused.retry_after_s <= 25.0 * 1.05
    snap = controller.snapshot()
    assert snap["budgets"]["t"]["refused_total"] == 2
    assert snap["queue"]["counters"]["refused:tenant_budget"] == 2


def test_a_waiter_whose_deadline_passes_is_refused_with_the_refill_left() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    ticket_of(submit(controller, "a", cost(300, 300)))
    waiter = submit(controller, "b", cost(100, 100), max_wait_s=25.0)  # 20 s of refill
    assert isinstance(waiter, Waiter)
    # Another request of the tenant takes the refill first (reserved elsewhere: here, by
    # hand on the bucket), so the waiter's deadline passes.
    bucket = controller.budgets._books["t"][TOKENS_PER_MINUTE]
    bucket.reserve(200)
    clock.advance(25.0)
    decision = controller.expire(waiter)
    assert isinstance(decision, Reject) and decision.reason == "tenant_budget"
    assert 15.0 <= decision.retry_after_s <= 15.0 * 1.05  # 150 short: 15 s


def test_a_request_larger_than_a_whole_window_is_a_400() -> None:
    controller, _ = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    refused = submit(controller, "a", cost(500, 200))
    assert isinstance(refused, Reject) and refused.status == 400
    assert refused.reason == "tenant_budget" and "can never start" in refused.message
    # A request that names no output cap is judged by its prompt, and reserves a window.
    open_ended = RequestCost(300, 4000, open_output=True)
    ticket = ticket_of(submit(controller, "b", open_ended))
    assert controller.budgets.status("t", 0.0)["tokens"].remaining == 0
    controller.release(ticket, Outcome.DONE, used_tokens=350)


def test_requests_per_minute_and_tokens_per_day_both_bind() -> None:
    limits = BudgetLimits(tokens_per_minute=PER_MINUTE, tokens_per_day=500, requests_per_minute=2)
    controller, clock = flow(limits)
    tickets = [ticket_of(submit(controller, f"r{i}", cost(10, 10))) for i in range(2)]
    refused = submit(controller, "x", cost(10, 10), max_wait_s=0.0)
    assert isinstance(refused, Reject) and refused.reason == "tenant_budget"
    assert 30.0 <= refused.retry_after_s <= 31.5  # one request a half minute
    for ticket in tickets:
        controller.release(ticket, Outcome.DONE, used_tokens=20)
    status = controller.budgets.status("t", clock.now())
    assert status["requests"].limit == 2 and status["requests"].remaining == 0
    # The day's budget has the least left: it is the one the headers tell.
    assert status["tokens"].limit == 500 and status["tokens"].remaining == 460
    tick(controller, clock, 30.0)
    ticket = ticket_of(submit(controller, "y", cost(200, 200)))
    refused = submit(controller, "z", cost(30, 50), max_wait_s=0.0)  # 20 short of the day's
    assert isinstance(refused, Reject)
    day_s = 20 * 86_400 / 500 - 30.0  # less the refill of the 30 s that passed
    assert day_s * 0.99 <= refused.retry_after_s <= day_s * 1.05
    controller.release(ticket, Outcome.DONE, used_tokens=400)


def test_a_request_that_never_reached_an_engine_costs_nothing() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE, requests_per_minute=5))
    ticket = ticket_of(submit(controller, "a", cost(100, 100)))
    controller.release(ticket, Outcome.UPSTREAM_ERROR, used_tokens=0)
    status = controller.budgets.status("t", clock.now())
    assert status["tokens"].remaining == PER_MINUTE and status["requests"].remaining == 5


def test_tenants_without_a_budget_and_requests_without_a_tenant_are_not_counted() -> None:
    controller, _ = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    for tenant in ("", "other"):
        decision = controller.submit(request(f"x-{tenant}", cost(500, 500), tenant=tenant))
        assert isinstance(decision, Admit)
    assert controller.budgets.status("other", 0.0) == {}
    assert controller.snapshot()["budgets"] == {}


def test_a_reloaded_budget_keeps_the_level_within_the_new_capacity() -> None:
    controller, clock = flow(BudgetLimits(tokens_per_minute=PER_MINUTE))
    ticket = ticket_of(submit(controller, "a", cost(100, 100)))
    controller.budgets.limits = {"t": BudgetLimits(tokens_per_minute=300)}
    status = controller.budgets.status("t", clock.now())["tokens"]
    assert status.limit == 300 and status.remaining == 300  # 400 left, at most a window
    controller.budgets.limits = {}
    controller.release(ticket, Outcome.DONE, used_tokens=150)  # its bucket is gone: no harm
    assert controller.budgets.status("t", clock.now()) == {}


def test_an_isolated_replica_tells_the_refill_of_its_own_part() -> None:
    """Cut off from the store among three replicas, a replica keeps a third of the window
    and gets a third of the refill: its waits are counted at that rate."""
    bucket = Bucket(PER_MINUTE, 60.0, now=0.0)
    bucket.isolate(3, 0.0)
    assert bucket.free(0.0) == pytest.approx(200)  # a third of the window
    bucket.reserve(200)
    bucket.settle(200, 200)
    # 100 tokens at a third of 10 a second, with 50 waiting before them: 45 s.
    assert bucket.wait(100, 50, 0.0) == pytest.approx(45.0)
    assert bucket.free(30.0) == pytest.approx(100)
    assert bucket.wait(100, 0, 30.0) == pytest.approx(0.0)
