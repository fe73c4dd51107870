"""Tenant books: randomised admit/cancel/fail sequences always end at exactly zero."""

from __future__ import annotations

import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Outcome
from kvgate.core.clock import ManualClock
from kvgate.core.policies import build_policy
from kvgate.core.request import Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import Lease, TenantLedger, TenantLimits
from kvgate.gateway.security.auth import TenantGate, current_tenant, exposure_message

_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
TENANTS = ("a", "b", "c")

steps = st.lists(
    st.tuples(
        st.sampled_from(["admit", "release", "release_twice", "observe"]),
        st.sampled_from(TENANTS),
        st.integers(min_value=0, max_value=3000),
        st.sampled_from(list(Outcome)),
    ),
    max_size=80,
)


@_SETTINGS
@given(steps=steps)
def test_ledger_alone_returns_to_zero(steps) -> None:
    ledger = TenantLedger({"a": TenantLimits(5000, 3)}, TenantLimits(max_in_flight_tokens=8000))
    leases: list[Lease] = []
    for action, tenant, tokens, _ in steps:
        if action == "admit":
            held = ledger.acquire(tenant, tokens)
            if isinstance(held, Lease):
                leases.append(held)
        elif leases:
            lease = leases.pop(tokens % len(leases))
            ledger.release(lease)
            if action == "release_twice":
                ledger.release(lease)
        for name in TENANTS:
            tokens_held, requests_held = ledger.held(name)
            limits = ledger.limits_for(name)
            assert tokens_held <= (limits.max_in_flight_tokens or 10**9)
            assert requests_held <= (limits.max_in_flight_requests or 10**9)
    for lease in leases:
        ledger.release(lease)
    assert ledger.total_tokens == 0 and ledger.total_requests == 0


@_SETTINGS
@given(steps=steps, policy=st.sampled_from(["none", "adaptive", "static-concurrency"]))
def test_tenant_gate_and_policy_books_both_return_to_zero(steps, policy: str) -> None:
    clock = ManualClock(100.0)
    inner = build_policy(AdmissionSettings(policy=policy, seed=1), clock)
    ledger = TenantLedger(default_limits=TenantLimits(max_in_flight_tokens=6000))
    gate = TenantGate(inner, ledger)
    for node in ("n0", "n1"):
        gate.add_node(node)
    tickets = []
    for i, (action, tenant, tokens, outcome) in enumerate(steps):
        clock.advance(0.01)
        if action == "observe":
            for node in ("n0", "n1"):
                gate.observe(node, NodeSample(0.3, 40000, 2, 0, 0.02, clock.now()))
            continue
        if action == "admit":
            token = current_tenant.set(tenant)
            try:
                cost = RequestCost(prompt_tokens=tokens // 2, max_output_tokens=tokens // 2)
                decision = gate.admit(f"r{i}", cost, Priority.STANDARD, ["n0", "n1"])
            finally:
                current_tenant.reset(token)
            if isinstance(decision, Admit):
                tickets.append(decision.ticket)
        elif tickets:
            ticket = tickets.pop(tokens % len(tickets))
            gate.release(ticket, outcome)
            if action == "release_twice":
                gate.release(ticket, outcome)
    for ticket in tickets:
        gate.release(ticket, Outcome.CLIENT_CANCEL)
    assert ledger.total_tokens == 0 and ledger.total_requests == 0
    snap = gate.snapshot()
    assert snap["in_flight_requests"] == 0
    assert all(s["reserved_tokens"] == 0 for s in snap["nodes"].values())
    assert all(u["in_flight_tokens"] == 0 for u in snap["tenants"].values())


def test_requests_without_a_tenant_are_not_charged() -> None:
    inner = build_policy(AdmissionSettings(policy="none"), ManualClock())
    ledger = TenantLedger(default_limits=TenantLimits(max_in_flight_tokens=1))
    gate = TenantGate(inner, ledger)
    gate.add_node("n0")
    decision = gate.admit("r", RequestCost(100, 100), Priority.STANDARD, ["n0"])
    assert isinstance(decision, Admit) and ledger.total_requests == 0
    gate.release(decision.ticket, Outcome.DONE)


def test_exposure_message_warns_on_public_binds_without_keys() -> None:
    assert exposure_message("127.0.0.1", 8080, 0, False)[0] == logging.INFO
    assert "loopback only" in exposure_message("127.0.0.1", 8080, 0, False)[1]
    assert exposure_message("::1", 8080, 0, False)[0] == logging.INFO
    level, text = exposure_message("0.0.0.0", 8080, 0, False)
    assert level == logging.WARNING and "NO API KEYS" in text
    level, text = exposure_message("0.0.0.0", 8080, 2, True)
    assert level == logging.INFO and "2 API key(s)" in text
