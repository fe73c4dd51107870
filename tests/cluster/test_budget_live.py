"""A tenant's budget held by three live `kvgate serve` replicas sharing a real redis-server
(`kvgate.testing.budget_run`): `benchmarks/budgets/` at a smaller scale (6,000 tokens a
minute, 20 clients, 20 s). The tokens served stay within what a full bucket and its
refill allow, and use at least 90% of it; every refusal is a 429 with a Retry-After,
which for the budget's (`tenant_budget`) is, at the median, within 20% of the true
bucket's refill time; with the store killed mid-run and started
again empty, still never more than the budget (an isolated replica keeps 1/3 of each
engine's room too, so a few of its waiters may time out: `queue_timeout`)."""

from __future__ import annotations

import pytest

from kvgate.testing.budget_run import BudgetLoad, BudgetRun, run_budget

pytestmark = [pytest.mark.timeout(240), pytest.mark.redis_server]

LOAD = BudgetLoad(
    tokens_per_minute=6000,  # 100 tokens a second
    clients=20,
    seconds=20.0,
    engines=1,
    prompt=(50, 150),
    output=(50, 250),
)


def assert_never_overspent(run: BudgetRun) -> None:
    """The issue's measure: the tokens of the requests started within the run, against
    what a full bucket and its refill allow. (The true bucket's lowest level, rebuilt
    from the access lines, depends on how late a loaded machine lets each gateway read its
    requests; the virtual-time tests replay it exactly: test_budget_replicas.py.)"""
    others = [(a.status, a.reason) for a in run.others]
    assert others == []  # every answer a 200 or a 429 with a Retry-After
    assert run.served <= run.bound


async def test_three_replicas_hold_the_budget_and_use_it() -> None:
    run = await run_budget(LOAD)
    assert_never_overspent(run)
    assert run.served >= 0.9 * run.bound, (run.served, run.bound)
    refusals = run.refusals()
    assert len(refusals) > 20  # the clients want far more than the budget
    # A replica knows the others' reservations and waiters as of their last view (50 ms):
    # its Retry-After is off by what they took or queued since, the more so on a machine
    # loaded by other work (benchmarks/budgets/results.md has the distribution).
    errors = sorted(r.error for r in refusals)
    assert errors[len(errors) // 2] <= 0.2, sorted(refusals, key=lambda r: -r.error)[:5]


async def test_the_store_killed_mid_run_never_costs_more_than_the_budget() -> None:
    run = await run_budget(BudgetLoad(**{**LOAD.__dict__, "store_down": (6.0, 12.0), "seed": 1}))
    assert_never_overspent(run)
    assert run.count(200) > 10
