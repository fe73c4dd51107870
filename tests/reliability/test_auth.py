"""API keys, tenants, priorities and the admin token, on a real gateway and engine."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging

import httpx
import pytest
from gateway.helpers import openai_error

from kvgate.core.tenants import TenantLedger, TenantLimits
from kvgate.gateway.security.auth import KeyRing, Security, load_keys
from kvgate.gateway.security.settings import AuthSettings
from kvgate.testing import FakeEngine
from kvgate.testing.books import ledger_totals

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef00"
ADMIN = "admin-token-0123456789"
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 10}


def _auth(**extra: object) -> dict[str, object]:
    keys = [
        {"key": ALICE, "tenant": "alice", "max_priority": "critical"},
        # Bob's key is stored as a digest only, and may not go above `standard`.
        {"key_sha256": hashlib.sha256(BOB.encode()).hexdigest(), "tenant": "bob",
         "default_priority": "sheddable", "max_priority": "standard"},
    ]  # fmt: skip
    return {"auth.keys": keys, "server.admin_token": ADMIN, **extra}


async def test_keys_are_required_and_never_forwarded(fake_engine: FakeEngine, gateway_factory):
    gw = await gateway_factory([fake_engine.url], overrides=_auth())
    async with httpx.AsyncClient(base_url=gw.url) as client:
        missing = await client.post("/v1/completions", json=BODY)
        wrong = await client.post(
            "/v1/completions", json=BODY, headers={"Authorization": "Bearer nope-" + ALICE}
        )
        ok = await client.post(
            "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {ALICE}"}
        )
        ok_header = await client.post("/v1/completions", json=BODY, headers={"x-api-key": BOB})
        health = await client.get("/healthz")
    for response, code in ((missing, "missing_api_key"), (wrong, "invalid_api_key")):
        assert response.status_code == 401
        error = openai_error(response.content)
        assert error["type"] == "authentication_error" and error["code"] == code
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert ok.status_code == 200 and ok_header.status_code == 200
    assert health.status_code == 200
    seen = fake_engine.completions()
    assert len(seen) == 2  # refused requests never reached the engine
    for request in seen:
        assert "authorization" not in request.headers and "x-api-key" not in request.headers
        assert "x-kvgate-priority" not in request.headers


async def test_priority_is_capped_by_the_key(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url], overrides=_auth())
    asked: list[tuple[str, str]] = []
    policy = gw.gateway.admission.policy
    original = policy.admit

    def spy(request, promised=None):  # records what the policy was asked
        asked.append((request.priority.label, request.tenant))
        return original(request, promised)

    policy.admit = spy
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for key, priority in ((BOB, None), (BOB, "critical"), (ALICE, "critical"), (ALICE, None)):
            headers = {"Authorization": f"Bearer {key}"}
            if priority:
                headers["X-Kvgate-Priority"] = priority
            assert (await client.post("/v1/completions", json=BODY, headers=headers)).is_success
        bad = await client.post(
            "/v1/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {ALICE}", "X-Kvgate-Priority": "urgent"},
        )
    # Bob: default sheddable, `critical` lowered to his maximum; Alice may ask for critical.
    # Each request reaches the core as its key's tenant.
    assert asked == [
        ("sheddable", "bob"),
        ("standard", "bob"),
        ("critical", "alice"),
        ("standard", "alice"),
    ]
    assert bad.status_code == 400 and openai_error(bad.content)["param"] == "X-Kvgate-Priority"


async def test_admin_routes_need_the_admin_token(fake_engine: FakeEngine, gateway_factory):
    gw = await gateway_factory([fake_engine.url], overrides=_auth())
    basic = base64.b64encode(f"ops:{ADMIN}".encode()).decode()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        anonymous = await client.get("/admin/state")
        client_key = await client.get("/admin/state", headers={"Authorization": f"Bearer {ALICE}"})
        admin = await client.get("/admin/state", headers={"Authorization": f"Bearer {ADMIN}"})
        dash = await client.get("/dashboard")
        dash_basic = await client.get("/dashboard", headers={"Authorization": f"Basic {basic}"})
        metrics = await client.get("/metrics")
    assert anonymous.status_code == 401 and client_key.status_code == 401
    assert openai_error(anonymous.content)["code"] == "invalid_admin_token"
    assert admin.status_code == 200 and "tenants" in admin.json()["policy"]
    assert dash.status_code == 401 and dash.headers["www-authenticate"].startswith("Basic")
    assert dash_basic.status_code == 200
    assert metrics.status_code == 200  # open for Prometheus


async def test_admin_routes_closed_without_admin_token(fake_engine: FakeEngine, gateway_factory):
    overrides = _auth()
    del overrides["server.admin_token"]
    gw = await gateway_factory([fake_engine.url], overrides=overrides)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        response = await client.get("/admin/state", headers={"Authorization": "Bearer x"})
    assert response.status_code == 403
    assert openai_error(response.content)["code"] == "admin_disabled"


async def test_without_keys_nothing_is_required(fake_engine: FakeEngine, gateway_factory):
    gw = await gateway_factory([fake_engine.url])
    assert not gw.gateway.security.front.enabled
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert (await client.get("/admin/state")).status_code == 200


@pytest.mark.parametrize(
    "tenants",
    [
        {"bob": {"max_in_flight_tokens": 600}},
        # "*": every tenant not listed (bob); alice, listed with no limits, has none.
        {"*": {"max_in_flight_tokens": 600}, "alice": {}},
    ],
    ids=["by-name", "any-other"],
)
async def test_tenant_token_limit_sheds_only_that_tenant(
    fake_engine: FakeEngine, gateway_factory, tenants: dict[str, object]
) -> None:
    # Each request costs prompt + 400 (+16 overhead in the `none` policy's books): one fits.
    overrides = _auth(**{"auth.tenants": tenants})
    gw = await gateway_factory([fake_engine.url], overrides=overrides)
    slow = {**BODY, "max_tokens": 400, "fake": {"delay": 0.5}}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = asyncio.create_task(
            client.post("/v1/completions", json=slow, headers={"x-api-key": BOB})
        )
        ledger = gw.gateway.security.ledger
        for _ in range(200):
            if ledger.held("bob")[1] == 1:
                break
            await asyncio.sleep(0.005)
        second = await client.post("/v1/completions", json=slow, headers={"x-api-key": BOB})
        other = await client.post("/v1/completions", json=BODY, headers={"x-api-key": ALICE})
        assert (await first).status_code == 200
    assert second.status_code == 429
    error = openai_error(second.content)
    assert error["code"] == "tenant_limit" and error["type"] == "rate_limit_error"
    assert second.headers["x-kvgate-reason"] == "tenant_limit"
    assert int(second.headers["retry-after"]) >= 1
    assert other.status_code == 200
    assert ledger.held("bob") == (0, 0) and ledger.held("alice") == (0, 0)
    metrics = (await httpx.AsyncClient(base_url=gw.url).get("/metrics")).text
    assert 'kvgate_tenant_in_flight_tokens{tenant="bob"} 0.0' in metrics
    assert 'kvgate_tenant_refused_total{tenant="bob"} 1.0' in metrics


def test_key_file_and_digest_lookup(tmp_path) -> None:
    key_file = tmp_path / "keys.yaml"
    key_file.write_text(f"keys:\n  - key: {BOB}\n    tenant: bob\n")
    settings = AuthSettings(keys=[{"key": ALICE, "tenant": "alice"}], key_file=str(key_file))
    ring = KeyRing(load_keys(settings))
    assert ring.find(ALICE.encode()).tenant == "alice"
    assert ring.find(BOB.encode()).tenant == "bob"
    assert ring.find(b"x" * 26) is None
    with pytest.raises(ValueError, match="twice"):
        load_keys(AuthSettings(keys=[{"key": ALICE, "tenant": "a"}, {"key": ALICE, "tenant": "b"}]))


@pytest.mark.parametrize(
    "entry",
    [
        {"key": "short", "tenant": "t"},
        {"tenant": "t"},
        {"key": ALICE, "key_sha256": "0" * 64, "tenant": "t"},
        {"key": ALICE, "tenant": "t", "default_priority": "critical", "max_priority": "standard"},
        {"key": ALICE, "tenant": "t", "max_priority": "urgent"},
    ],
)
def test_invalid_key_entries_are_config_errors(entry: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        AuthSettings(keys=[entry])


def test_star_is_every_tenant_not_listed_and_no_tenant_name() -> None:
    auth = AuthSettings(
        tenants={
            "*": {"max_in_flight_requests": 2},
            "alice": {"max_in_flight_requests": 5},
            "bob": {},
        }
    )
    ledger = Security.from_config(auth, None).ledger
    assert ledger.limits_for("carol") == TenantLimits(max_in_flight_requests=2)
    assert ledger.limits_for("alice") == TenantLimits(max_in_flight_requests=5)
    assert ledger.limits_for("bob") == TenantLimits()  # listed: its own limits, none
    assert "*" not in ledger.limits
    with pytest.raises(ValueError, match=r"`\*` is not a tenant name"):
        AuthSettings(keys=[{"key": ALICE, "tenant": "*"}])


def test_ledger_refuses_and_releases_exactly_once() -> None:
    ledger = TenantLedger({"t": TenantLimits(max_in_flight_tokens=100, max_in_flight_requests=2)})
    a = ledger.acquire("t", 60)
    assert ledger.acquire("t", 50).limit == "tokens"
    b = ledger.acquire("t", 40)
    assert ledger.acquire("t", 0).limit == "requests"
    ledger.release(a)
    ledger.release(a)  # idempotent
    assert ledger.held("t") == (40, 1)
    ledger.release(b)
    assert ledger.held("t") == (0, 0) and ledger_totals(ledger)[0] == 0
    assert ledger.acquire("t", 101).limit == "tokens"  # can never fit
    assert ledger.never_fits("t", 101) is not None and ledger.never_fits("t", 100) is None
    assert ledger.snapshot()["t"]["admitted_total"] == 2


async def test_start_up_says_who_can_reach_the_gateway(
    fake_engine: FakeEngine, gateway_factory, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.gateway.http.server")
    await gateway_factory([fake_engine.url])
    await gateway_factory([fake_engine.url], overrides=_auth())
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.gateway.http.server"]
    assert any("no API keys configured" in m and "loopback only" in m for m in lines), lines
    assert any("2 API key(s) configured" in m for m in lines), lines
    assert not any(ALICE in m or ADMIN in m for m in caplog.text.splitlines())


def test_a_bad_key_file_is_a_configuration_error(tmp_path) -> None:
    from kvgate.config import load_config

    with pytest.raises(ValueError, match="key_file"):
        load_config(None, **{"auth.key_file": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: 7\n")
    with pytest.raises(ValueError, match="expected a list"):
        load_config(None, **{"auth.key_file": str(bad)})
