"""Tenant books: randomised submit/wait/cancel/expire/release sequences always end at zero.

The tenants' limits live in the core's flow controller (`TenantLedger`): a request takes its
tenant's lease when it starts, whether at once or after waiting, and gives it back with its
hold in the one `release()` the shell calls. Whatever happens in between (waiters that are
cancelled or expire, tickets released twice, nodes that report), no tenant ever holds more
than its limits and every book returns to exactly zero.
"""

from __future__ import annotations

import logging

from core.helpers import assert_flow_empty
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.policies.baselines import build_named
from kvgate.core.request import DEFAULT_TENANT, AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import Lease, TenantLedger, TenantLimits
from kvgate.gateway.security.auth import exposure_message
from kvgate.testing.books import ledger_totals

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
TENANTS = ("a", "b", "c")
NODES = ("n0", "n1")
LIMITS = {"a": TenantLimits(5000, 3)}
DEFAULT_LIMITS = TenantLimits(max_in_flight_tokens=8000)

steps = st.lists(
    st.tuples(
        st.sampled_from(
            ["submit", "submit", "release", "release_twice", "observe", "cancel", "expire"]
        ),
        st.sampled_from(TENANTS),
        st.integers(min_value=0, max_value=3000),
        st.sampled_from(list(Outcome)),
    ),
    max_size=80,
)


def _within_limits(ledger: TenantLedger) -> None:
    for name in TENANTS:
        tokens_held, requests_held = ledger.held(name)
        limits = ledger.limits_for(name)
        assert 0 <= tokens_held <= (limits.max_in_flight_tokens or 10**9)
        assert 0 <= requests_held <= (limits.max_in_flight_requests or 10**9)


@_SETTINGS
@given(steps=steps)
def test_ledger_alone_returns_to_zero(steps) -> None:
    ledger = TenantLedger(LIMITS, DEFAULT_LIMITS)
    leases: list[Lease] = []
    for action, tenant, tokens, _ in steps:
        if action == "submit":
            held = ledger.acquire(tenant, tokens)
            if isinstance(held, Lease):
                leases.append(held)
        elif action.startswith("release") and leases:
            lease = leases.pop(tokens % len(leases))
            ledger.release(lease)
            if action == "release_twice":
                ledger.release(lease)
        _within_limits(ledger)
    for lease in leases:
        ledger.release(lease)
    assert ledger_totals(ledger) == (0, 0)


@_SETTINGS
@given(steps=steps, policy=st.sampled_from(["none", "adaptive", "static-concurrency"]))
def test_flow_and_tenant_books_both_return_to_zero(steps, policy: str) -> None:
    clock = ManualClock(100.0)
    ledger = TenantLedger(LIMITS, DEFAULT_LIMITS)
    flow = FlowController(
        build_named(policy, AdmissionSettings(), clock, rng_seed=1), tenants=ledger
    )
    for node in NODES:
        flow.add_node(node)
    tickets: list[Ticket] = []
    waiters: list[Waiter] = []

    def started(decision: Decision) -> None:
        if isinstance(decision, Admit):
            assert decision.ticket.key in flow._leases  # the lease came with the hold
            tickets.append(decision.ticket)

    for i, (action, tenant, tokens, outcome) in enumerate(steps):
        clock.advance(0.01)
        if action == "observe":
            for node in NODES:
                flow.observe(node, NodeSample(0.3, 40000, 2, 0, 0.02, clock.now()))
        elif action == "submit":
            cost = RequestCost(prompt_tokens=tokens // 2, max_output_tokens=tokens // 2)
            decision = flow.submit(AdmissionRequest(f"r{i}", cost, tenant=tenant, candidates=NODES))
            if isinstance(decision, Waiter):
                decision.notify = started
                waiters.append(decision)
            else:
                started(decision)
        elif action in ("cancel", "expire"):
            live = [w for w in waiters if w.waiting]
            if live:
                waiter = live[tokens % len(live)]
                if action == "cancel":
                    flow.cancel(waiter)
                else:
                    clock.set(max(clock.now(), waiter.deadline))
                    assert isinstance(flow.expire(waiter), Reject)
        elif tickets:
            ticket = tickets.pop(tokens % len(tickets))
            flow.release(ticket, outcome)
            if action == "release_twice":
                flow.release(ticket, outcome)
        _within_limits(ledger)
        for name in TENANTS:
            mine = [t for t in tickets if t.request.tenant == name]
            assert ledger.held(name) == (sum(t.request.cost.total for t in mine), len(mine))
    for waiter in waiters:
        flow.cancel(waiter)
    for ticket in tickets:
        flow.release(ticket, Outcome.CLIENT_CANCEL)
    assert_flow_empty(flow)
    snap = flow.snapshot()
    assert all(u["in_flight_tokens"] == 0 for u in snap["tenants"].values())
    assert all(u["in_flight_requests"] == 0 for u in snap["tenants"].values())


def _flow(ledger: TenantLedger) -> tuple[FlowController, ManualClock]:
    clock = ManualClock(100.0)
    flow = FlowController(build_policy(AdmissionSettings(), clock, rng_seed=1), tenants=ledger)
    flow.observe("n0", NodeSample(0.1, 100_000, 1, 0, 0.02, clock.now()))
    return flow, clock


def _request(name: str, tenant: str, tokens: int = 200) -> AdmissionRequest:
    cost = RequestCost(tokens // 2, tokens // 2)
    return AdmissionRequest(name, cost, Priority.STANDARD, tenant=tenant, candidates=("n0",))


def test_a_tenant_at_its_limit_waits_for_one_of_its_own_requests_to_end() -> None:
    flow, clock = _flow(TenantLedger({"a": TenantLimits(max_in_flight_requests=1)}))
    first = flow.submit(_request("1", "a"))
    assert isinstance(first, Admit)
    clock.advance(0.4)
    flow.release(first.ticket, Outcome.DONE)  # the tenant's rate of freeing room is known
    second = flow.submit(_request("2", "a"))
    assert isinstance(second, Admit)
    third = flow.submit(_request("3", "a"))
    assert isinstance(third, Waiter)  # the cluster has room; the tenant has not
    other = flow.submit(_request("x", "b"))
    assert isinstance(other, Admit)  # another tenant is not held up
    told: list[Decision] = []
    third.notify = told.append
    clock.advance(0.5)
    flow.release(second.ticket, Outcome.DONE)
    ((granted,),) = (told,)
    assert isinstance(granted, Admit) and granted.ticket.waited_s == 0.5
    for ticket in (granted.ticket, other.ticket):
        flow.release(ticket, Outcome.DONE)
    assert_flow_empty(flow)


def test_a_request_larger_than_its_tenants_whole_limit_is_a_400() -> None:
    flow, _ = _flow(TenantLedger({"a": TenantLimits(max_in_flight_tokens=1000)}))
    refused = flow.submit(_request("big", "a", tokens=2000))
    assert isinstance(refused, Reject) and refused.status == 400
    assert refused.reason == "tenant_limit" and "never start" in refused.message
    assert flow.snapshot()["tenants"]["a"]["refused_total"] == 1
    assert_flow_empty(flow)


def test_a_tenants_first_burst_over_its_limit_waits_too() -> None:
    """Before the tenant has freed anything (no measured rate), its own running requests
    still say when it will have room."""
    flow, _ = _flow(TenantLedger({"a": TenantLimits(max_in_flight_requests=1)}))
    first = flow.submit(_request("1", "a"))
    assert isinstance(first, Admit)
    second = flow.submit(_request("2", "a"))
    assert isinstance(second, Waiter)
    told: list[Decision] = []
    second.notify = told.append
    flow.release(first.ticket, Outcome.DONE)
    ((granted,),) = (told,)
    assert isinstance(granted, Admit)
    flow.release(granted.ticket, Outcome.DONE)
    assert_flow_empty(flow)


def test_requests_without_a_tenant_are_not_held_to_tenant_limits() -> None:
    ledger = TenantLedger(default_limits=TenantLimits(max_in_flight_tokens=1))
    flow, _ = _flow(ledger)
    decision = flow.submit(_request("r", DEFAULT_TENANT))
    assert isinstance(decision, Admit)
    flow.release(decision.ticket, Outcome.DONE)


def test_exposure_message_warns_on_public_binds_without_keys() -> None:
    assert exposure_message("127.0.0.1", 8080, 0, False)[0] == logging.INFO
    assert "loopback only" in exposure_message("127.0.0.1", 8080, 0, False)[1]
    assert exposure_message("::1", 8080, 0, False)[0] == logging.INFO
    level, text = exposure_message("0.0.0.0", 8080, 0, False)
    assert level == logging.WARNING and "NO API KEYS" in text
    level, text = exposure_message("0.0.0.0", 8080, 2, True)
    assert level == logging.INFO and "2 API key(s)" in text
