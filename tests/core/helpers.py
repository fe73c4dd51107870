"""Shared builders for the core tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvgate.core.admission import Decision
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.baselines import BaselineOptions, build_named, policy_name
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import AdmissionSettings, QueueSettings, Tuning
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import TenantLedger
from kvgate.testing.books import full_reserved_on, ledger_totals

_TUNING = frozenset(f.name for f in dataclasses.fields(Tuning))
_BASELINE = {"static_qps": "qps", "static_burst": "burst", "static_concurrency": "concurrency"}


def admission_settings(**overrides: Any) -> AdmissionSettings:
    """Settings from flat keyword overrides: `Tuning` fields go through `tuned()`, the rest
    are settings."""
    tuning = {k: overrides.pop(k) for k in list(overrides) if k in _TUNING}
    settings = AdmissionSettings(**overrides)
    return settings.tuned(**tuning) if tuning else settings


def make(
    policy: str = "adaptive", seed: int = 1, **overrides: Any
) -> tuple[BasePolicy, ManualClock]:
    """The policy called `policy`; the baselines' `static_*` quotas among `overrides` go to
    its `BaselineOptions`, the rest to `admission_settings`."""
    clock = ManualClock(100.0)
    quotas = {_BASELINE[k]: overrides.pop(k) for k in list(overrides) if k in _BASELINE}
    settings = admission_settings(**overrides)
    options = BaselineOptions(**quotas)
    built = build_named(policy_name(policy), settings, clock, rng_seed=seed, options=options)
    assert isinstance(built, BasePolicy)
    return built, clock


def make_flow(
    policy: str = "adaptive",
    seed: int = 1,
    *,
    queue: QueueSettings | None = None,
    tenants: TenantLedger | None = None,
    **overrides: Any,
) -> tuple[FlowController, ManualClock]:
    """A flow controller around `make(policy, ...)`'s policy."""
    built, clock = make(policy, seed, **overrides)
    return FlowController(built, queue, tenants=tenants), clock


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


def request(
    request_id: str,
    c: RequestCost | None = None,
    priority: Priority = Priority.STANDARD,
    candidates: Sequence[str] = ("a",),
    **fields: Any,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id, c or cost(), priority, candidates=tuple(candidates), **fields
    )


def admit(
    policy: BasePolicy,
    request_id: str,
    c: RequestCost | None = None,
    priority: Priority = Priority.STANDARD,
    candidates: Sequence[str] = ("a",),
    **fields: Any,
) -> Decision:
    """The policy's answer for one request (no queue)."""
    return policy.admit(request(request_id, c, priority, candidates, **fields))


def assert_books_empty(policy: BasePolicy) -> None:
    """Every hold and in-flight counter is back to exactly zero."""
    assert policy.in_flight_requests == 0
    assert policy.in_flight_tokens == 0
    assert not policy.holds.live and not policy.holds.books
    snap = policy.snapshot()
    assert snap["in_flight_requests"] == 0
    assert snap["controller"]["in_flight_tokens"] == 0
    for node_id, node in snap["nodes"].items():
        assert node["reserved_tokens"] == 0
        assert node["in_flight"] == 0
        assert full_reserved_on(policy, node_id) == 0
        assert policy.holds.unreflected_now(node_id) == 0


def assert_flow_empty(flow: FlowController) -> None:
    """The policy's books, the tenants' books and the queue are all back to zero."""
    assert_books_empty(flow.policy)
    assert flow.waiting == 0 and flow.queue.tokens == 0
    assert not list(flow.queue.waiting())
    assert not flow._leases
    assert ledger_totals(flow.tenants) == (0, 0)
    snap = flow.snapshot()
    assert snap["queue"]["waiting"] == 0 and snap["queue"]["tokens"] == 0
    for band in snap["queue"]["bands"].values():
        assert band == {"waiting": 0, "tokens": 0, "oldest_s": 0.0}
    for tenant in snap["tenants"].values():
        assert tenant["in_flight_tokens"] == 0 and tenant["in_flight_requests"] == 0
