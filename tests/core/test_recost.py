"""Waiters re-costed in virtual time: a better count of a waiting request's prompt gives
it its new cost where it stands in the queue, and what fits then starts at once."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.core.admission import Admit
from kvgate.core.flow import Waiter
from kvgate.core.request import AdmissionRequest, RequestCost
from tests.core.flowkit import Bench

ESTIMATED = RequestCost(880, 400, 800)  # "hello " * 400 at 3 characters a token, x 1.1
EXACT = RequestCost(400, 400, 400, prompt_exact=True)  # what the engine counts


def waiting(bench: Bench) -> list[Waiter]:
    return list(bench.flow.queue.order())


def test_a_better_count_starts_what_now_fits_and_keeps_the_order() -> None:
    """The issue's burst: at its estimated 1,296 tokens a node of 4,096 runs two of these
    at a time; counted exactly (816), what fits starts as soon as the counts arrive, and
    the queue keeps its order."""
    bench = Bench()
    results = [bench.submit(880, 400, name=f"r{i}") for i in range(8)]
    assert [isinstance(r, Admit) for r in results] == [True, True] + [False] * 6
    assert bench.flow.queue.tokens == 6 * ESTIMATED.total
    ids = tuple(range(400))
    changes = []
    for waiter in waiting(bench):
        request = dataclasses.replace(waiter.request, cost=EXACT, prompt_ids=ids)
        changes.append((waiter, request))
    bench.flow.recost(changes)
    started = [rid for rid in bench.order if rid not in ("r0", "r1")]
    assert started and started == [f"r{i}" for i in range(2, 2 + len(started))]
    assert all(w.request.cost == EXACT and w.request.prompt_ids == ids for w in waiting(bench))
    assert [w.request.request_id for w in waiting(bench)] == [
        f"r{i}" for i in range(2 + len(started), 8)
    ]
    assert bench.flow.queue.tokens == len(waiting(bench)) * EXACT.total
    bench.run_until_idle()
    assert bench.order == [f"r{i}" for i in range(8)]
    assert bench.books_empty()


def test_the_same_burst_counted_exactly_runs_more_at_once_than_estimated() -> None:
    """What the re-costing buys: with exact counts from the start, four run at once."""
    for cost, at_once in ((ESTIMATED, 2), (EXACT, 4)):
        bench = Bench()
        results = [bench.submit(cost.prompt_tokens, 400) for _ in range(8)]
        assert sum(isinstance(r, Admit) for r in results) == at_once


def test_a_larger_count_is_taken_too_and_a_waiter_that_left_is_skipped() -> None:
    bench = Bench()
    for i in range(3):
        bench.submit(500, 500, name=f"fill{i}")
    small = bench.submit(500, 500, name="small")
    gone = bench.submit(500, 500, name="gone")
    assert isinstance(small, Waiter) and isinstance(gone, Waiter)
    bench.flow.cancel(gone)
    bigger = dataclasses.replace(small.request, cost=RequestCost(700, 500))
    ignored = dataclasses.replace(gone.request, cost=RequestCost(1, 1))
    bench.flow.recost([(small, bigger), (gone, ignored)])
    assert small.request is bigger and small.tokens == 1200
    assert gone.request is not ignored
    assert bench.flow.queue.tokens == 1200
    bench.run_until_idle()
    assert bench.admitted("small") and bench.books_empty()


def test_a_waiter_keeps_its_band_and_tenant() -> None:
    bench = Bench()
    for i in range(3):
        bench.submit(500, 500, name=f"fill{i}")
    waiter = bench.submit(500, 500, tenant="a")
    assert isinstance(waiter, Waiter)
    other: AdmissionRequest = dataclasses.replace(waiter.request, tenant="b")
    with pytest.raises(ValueError, match="priority and tenant"):
        bench.flow.recost([(waiter, other)])
