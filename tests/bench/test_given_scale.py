"""The capacity text of a live run whose 1x was not measured live."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvgate.bench.driver import BenchOptions, given_scale_how


def _opts(loads: list[float], policies: list[str]) -> BenchOptions:
    args = argparse.Namespace(
        mode="live-vllm", quick=False, nodes=None, out=Path("/tmp/unused"), preset=None,
        duration=30.0, warmup=None, loads=loads, policies=policies, seeds=None,
        retry="immediate", max_attempts=4, timeout=None, capacity_scale=0.9,
        scrape_interval=None, jobs=1,
    )  # fmt: skip
    return BenchOptions.from_args(args, "kvgate bench live-vllm")


def test_live_direct_at_1x_is_the_live_capacity() -> None:
    text = given_scale_how(_opts([1.0, 3.0], ["direct", "adaptive"]), "search")
    assert "(search)" in text
    assert "the live capacity is the goodput `direct` achieved live at 1x" in text


@pytest.mark.parametrize(
    ("loads", "policies"),
    [([3.0, 24.0], ["direct", "adaptive"]), ([1.0, 3.0], ["adaptive-fixed", "adaptive"])],
)
def test_without_a_live_direct_1x_the_figures_are_said_virtual(
    loads: list[float], policies: list[str]
) -> None:
    text = given_scale_how(_opts(loads, policies), "search")
    assert "no live `direct` run at 1x" in text
    assert "are the virtual run's at this scale" in text
    assert "achieved live" not in text
