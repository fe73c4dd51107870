"""Shared builders for the core tests."""

from __future__ import annotations

from typing import Any

from kvgate.core.clock import ManualClock
from kvgate.core.policies import build_policy
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample


def make(
    policy: str = "adaptive", seed: int = 1, **overrides: Any
) -> tuple[BasePolicy, ManualClock]:
    clock = ManualClock(100.0)
    settings = AdmissionSettings(policy=policy, **overrides)  # type: ignore[arg-type]
    built = build_policy(settings, clock, rng_seed=seed)
    assert isinstance(built, BasePolicy)
    return built, clock


def sample(
    clock: ManualClock,
    usage: float | None = 0.1,
    capacity: int | None = 10_000,
    running: int = 1,
    waiting: int = 0,
    latency: float | None = 0.02,
    at: float | None = None,
) -> NodeSample:
    return NodeSample(
        kv_usage=usage,
        kv_capacity_tokens=capacity,
        running=running,
        waiting=waiting,
        iteration_latency_s=latency,
        sampled_at=clock.now() if at is None else at,
    )


def cost(prompt: int = 100, output: int = 100) -> RequestCost:
    return RequestCost(prompt_tokens=prompt, max_output_tokens=output)


def assert_books_empty(policy: BasePolicy) -> None:
    """Every reservation and in-flight counter is back to exactly zero."""
    assert policy.in_flight_requests == 0
    assert policy.in_flight_tokens == 0
    assert policy.store.total_reserved() == 0
    assert policy.store.total_count() == 0
    snap = policy.snapshot()
    assert snap["in_flight_requests"] == 0
    assert snap["controller"]["in_flight_tokens"] == 0
    for node in snap["nodes"].values():
        assert node["reserved_tokens"] == 0
        assert node["in_flight"] == 0
