"""The live capacity search (`find_capacity_near`): from a guess, with few runs."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from kvgate.bench import suite
from kvgate.bench.profiles import get_profile
from kvgate.bench.suite import RunSpec, find_capacity_near


def _base() -> RunSpec:
    prof = get_profile("cpu-tiny")
    return RunSpec(
        preset="cpu-tiny", nodes=1, shape=prof.shape, load=1.0, seed=1, duration_s=60.0,
        warmup_s=5.0, client=prof.client, slo=prof.slo, label="direct", policy="none",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("capacity", "guess", "expected_runs"),
    [(0.9, 0.3, 5), (0.1, 0.3, 5), (0.5, 0.3, 4)],
)
def test_brackets_from_the_guess_then_bisects_twice(
    monkeypatch: pytest.MonkeyPatch, capacity: float, guess: float, expected_runs: int
) -> None:
    """A machine that sustains `capacity` x the mix (the truth the runs reveal)."""
    base = _base()
    tried: list[float] = []

    def runner(spec: RunSpec) -> Any:
        scale = spec.shape.chat_rate / base.shape.chat_rate
        tried.append(scale)
        return SimpleNamespace(scale=scale)

    monkeypatch.setattr(suite, "passes_capacity", lambda run: run.scale <= capacity + 1e-9)
    scale, run = find_capacity_near(base, runner, guess)
    assert len(tried) == expected_runs
    assert scale <= capacity and run is not None and run.scale == pytest.approx(scale)
    # Within a factor of 2 ** (1/4) of the truth after two bisections of a doubling bracket.
    assert scale > capacity / 2**0.25


def test_a_machine_that_sustains_nothing_tried_has_no_capacity_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = _base()
    monkeypatch.setattr(suite, "passes_capacity", lambda run: False)
    scale, run = find_capacity_near(base, lambda spec: SimpleNamespace(), 0.4, widen=2)
    assert run is None and scale == pytest.approx(0.1)


def test_the_search_keeps_the_base_spec_but_its_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base()
    specs: list[RunSpec] = []
    monkeypatch.setattr(suite, "passes_capacity", lambda run: True)
    find_capacity_near(base, lambda spec: specs.append(spec) or SimpleNamespace(), 1.0, widen=1)
    assert [s.shape for s in specs] == [base.shape.scaled(1.0), base.shape.scaled(2.0)]
    assert all(replace(s, shape=base.shape) == base for s in specs)
