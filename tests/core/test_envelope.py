"""The KV envelope against a step-by-step simulation of the same requests."""

from __future__ import annotations

import random

import pytest

from kvgate.core.plan.envelope import Envelope
from kvgate.testing.books import envelope_upper_bound


def simulated_peak(base: int, loads: list[tuple[int, int]], held: int, steps: int) -> int:
    """Usage at every step (and just before every end), the slow and obvious way."""
    horizon = max([r for r, _ in loads] + [steps, 0]) + 2
    best = base + held
    newcomer = held > 0 or steps > 0
    for s in range(horizon + 1):
        before_end = base  # requests ending at s still hold what they grew to
        after = base
        for remaining, holds in loads:
            before_end += s if remaining >= s else -holds
            after += s if remaining > s else -holds
        if newcomer and s <= steps:
            before_end += held + s
        if newcomer and s < steps:
            after += held + s
        best = max(best, before_end, after)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_peak_matches_a_step_by_step_simulation(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        loads = [(rng.randint(0, 12), rng.randint(0, 30)) for _ in range(rng.randint(0, 8))]
        base = sum(h for _, h in loads) + rng.randint(0, 20)
        held, steps = rng.choice([(0, 0), (rng.randint(0, 30), rng.randint(0, 15))])
        got = Envelope(base, loads).peak(held, steps)
        assert got == simulated_peak(base, loads, held, steps), (base, loads, held, steps)


def test_adding_a_request_equals_building_with_it() -> None:
    rng = random.Random(7)
    for _ in range(200):
        loads = [(rng.randint(0, 20), rng.randint(1, 50)) for _ in range(rng.randint(0, 10))]
        base = sum(h for _, h in loads)
        env = Envelope(base, loads)
        env.add(40, 9)
        assert env.peak(5, 3) == Envelope(base + 40, [*loads, (9, 40)]).peak(5, 3)


@pytest.mark.parametrize("seed", range(3))
def test_start_step_is_safe_and_no_later_than_the_first_end_after_which_all_fits(
    seed: int,
) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        loads = [(rng.randint(0, 12), rng.randint(1, 30)) for _ in range(rng.randint(0, 8))]
        base = sum(h for _, h in loads) + rng.randint(0, 10)
        env = Envelope(base, loads)
        final = rng.randint(1, 40)
        limit = base + rng.randint(-20, 60)
        start = env.start_step(final, limit)
        if start is None:
            assert env.base_after_all() + final > limit
            continue
        # From `start` on, everything still running plus the newcomer at its largest fits.
        remaining = [(r - start, h + start) for r, h in loads if r > start]
        freed = sum(h for r, h in loads if r <= start)
        later = Envelope(base - freed + start * len(remaining), remaining)
        assert later.peak() + final <= limit
        # Once every running request has ended it fits, so the answer is never past then.
        assert start <= max([r for r, _ in loads] + [0])


def test_an_empty_node_fits_anything_under_its_limit_at_once() -> None:
    env = Envelope(100)
    assert env.peak(50, 10) == 160
    assert env.start_step(60, 160) == 0
    assert env.start_step(61, 160) is None


def test_the_upper_bound_is_an_upper_bound() -> None:
    rng = random.Random(3)
    for _ in range(200):
        loads = [(rng.randint(0, 20), rng.randint(1, 50)) for _ in range(rng.randint(0, 10))]
        env = Envelope(sum(h for _, h in loads), loads)
        assert env.peak() <= envelope_upper_bound(env)
