"""A tenant's budget shared by replicas, in virtual time: the real flow controllers and sync
tasks through the in-process store, each replica at its own phase (`budget_rig`). Every
reservation and settle is replayed into the one true bucket, which must never be
overspent: synced, with the store down or wiped, with a replica killed or one joining."""

from __future__ import annotations

import pytest

from kvgate.core.budgets import BudgetLimits
from kvgate.core.budgets.bucket import CLAIM_WAIT_S

from .budget_rig import TENANT, Rig

PER_MINUTE = 6000  # 100 tokens a second
LIMITS = BudgetLimits(tokens_per_minute=PER_MINUTE)


def budget(seconds: float) -> float:
    """What a full bucket lets through in `seconds`."""
    return PER_MINUTE * (1 + seconds / 60)


def assert_never_overspent(rig: Rig) -> None:
    assert rig.oracle.lowest >= -1e-6, f"the bucket went {rig.oracle.lowest:.1f} below zero"


@pytest.mark.parametrize("replicas", [1, 3, 5])
async def test_replicas_never_overspend_and_use_the_budget(replicas: int) -> None:
    rig = Rig(replicas, LIMITS, clients=30, seed=replicas)
    await rig.run(90.0)
    assert_never_overspent(rig)
    served = rig.oracle.used + rig.oracle.reserved  # what ran, and what runs still
    assert served <= budget(90.0)
    assert served >= 0.9 * budget(90.0), (served, rig.answers)
    assert rig.answers["refused"] > 0  # the clients want far more than the budget


@pytest.mark.parametrize(
    ("sizes", "max_wait_s"), [((40, 120), 8.0), ((60, 200), 6.0), ((40, 120), 4.0)]
)
async def test_retry_after_is_the_refill_time_across_replicas(
    sizes: tuple[int, int], max_wait_s: float
) -> None:
    """Each refusal's Retry-After against the true bucket's refill time for it and the
    tenant's waiters before it, at every replica. A replica sees the others' waiters and
    reservations as of their last view (up to 50 ms old), and room claimed by another
    replica is a sync or two away (`CLAIM_WAIT_S`)."""
    rig = Rig(3, LIMITS, clients=30, sizes=sizes, max_wait_s=max_wait_s, seed=7)
    await rig.run(60.0)
    assert_never_overspent(rig)
    late = [r for r in rig.refusals if r.at > 1005.0]  # after the first burst
    assert len(late) > 100
    slack = CLAIM_WAIT_S * 1.05
    off = [r for r in late if abs(r.retry_after_s - r.real_wait_s) > 0.2 * r.real_wait_s + slack]
    assert len(off) <= 0.03 * len(late), off[:5]


async def test_refunds_return_what_requests_did_not_use() -> None:
    rig = Rig(3, LIMITS, clients=30, use=0.5, seed=3)
    await rig.run(60.0)
    assert_never_overspent(rig)
    # Each request used half its output: with refunds the tenant ran more requests than
    # their reservations alone allow, and consumed about its budget.
    assert rig.oracle.used + rig.oracle.reserved >= 0.85 * budget(60.0)


@pytest.mark.parametrize("phases", [(0.0, 0.001, 0.002), (0.0, 0.024, 0.049)])
async def test_replicas_ticking_close_together_or_apart_never_overspend(
    phases: tuple[float, ...],
) -> None:
    rig = Rig(3, LIMITS, clients=40, sizes=(50, 150), seed=11)
    for replica, phase in zip(rig.replicas, phases, strict=True):
        replica.phase = phase
    await rig.run(60.0)
    assert_never_overspent(rig)


async def test_the_store_down_mid_run_each_replica_keeps_a_third() -> None:
    rig = Rig(3, LIMITS, clients=30, seed=5)
    await rig.run(30.0)
    rig.store.available = False
    await rig.run(40.0)
    assert all(r.flow.budgets.mode == "isolated" for r in rig.replicas)
    rig.store.available = True
    await rig.run(20.0)
    assert all(r.flow.budgets.mode == "synced" for r in rig.replicas)
    assert_never_overspent(rig)
    assert rig.oracle.used + rig.oracle.reserved <= budget(90.0)


async def test_a_store_restarted_empty_forgets_nothing_of_the_budgets() -> None:
    rig = Rig(3, LIMITS, clients=30, seed=6)
    await rig.run(30.0)
    rig.store.wipe()
    await rig.run(30.0)
    assert_never_overspent(rig)
    assert rig.oracle.used + rig.oracle.reserved <= budget(60.0)


async def test_a_killed_replica_is_taken_to_have_used_all_it_held() -> None:
    rig = Rig(3, LIMITS, clients=30, seed=8)
    await rig.run(20.0)
    held = len(rig.replicas[0].running)
    rig.kill(0)
    await rig.run(40.0)
    assert_never_overspent(rig)
    assert held >= 0 and all(r.flow.budgets.members == 2 for r in rig.alive())
    # The other two go on serving the whole refill between them.
    assert rig.oracle.used + rig.oracle.reserved >= 0.8 * budget(60.0)


async def test_a_replica_that_joins_learns_the_level_and_serves() -> None:
    rig = Rig(2, LIMITS, clients=30, seed=9)
    await rig.run(20.0)
    joined = rig.add_replica(phase=0.013)
    await rig.run(30.0)
    assert_never_overspent(rig)
    bucket = joined.flow.budgets._books[TENANT]
    assert all(b.seeded for b in bucket.values())
    assert (
        joined.flow.budgets.snapshot(rig.clock.now())[TENANT]["windows"]["tokens_per_minute"][
            "spent"
        ]
        > 0
    )


async def test_replicas_back_on_a_store_restarted_empty_charge_each_other_their_third() -> None:
    """Back on an empty store, the first replicas to exchange see the others gone, and
    charge them what they may have used while cut off: a third of the refill each (the
    part they kept to), not the whole refill the membership of the moment would give
    them. So every replica's level is the true one again, not half a minute below it (its
    Retry-Afters would be that much too long)."""
    rig = Rig(3, LIMITS, clients=30, seed=12)
    await rig.run(30.0)
    rig.store.available = False
    rig.store.wipe()
    await rig.run(20.0)
    rig.store.available = True
    await rig.run(1.0)
    assert_never_overspent(rig)
    now = rig.clock.now()
    truth = rig._oracle_free()
    for replica in rig.replicas:
        (bucket,) = replica.flow.budgets._books[TENANT].values()
        assert bucket.unreserved(now) >= truth - 0.1 * PER_MINUTE, (replica.name, truth)
