"""Tenants made visible: the access log names each request's tenant, and `/admin/state`'s
`tenants` table (which the dashboard and `kvgate status` draw) has, per tenant, what it
has in flight and waiting, what kvgate refused it, what the engines served it and what is
left of its budget."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from kvgate import status
from kvgate.gateway.ops.tenants import COLUMNS, TenantTally, tenant_table
from kvgate.testing import FakeEngine, eventually

ALICE = "alice-key-0123456789abcdef00"
BOB = "bob-key-0123456789abcdef0000"
ADMIN = "admin-token-0123456789"
BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 10}


def _rows(state: dict[str, object]) -> dict[str, dict[str, int]]:
    table = state["tenants"]
    assert isinstance(table, dict)
    return {row["tenant"]: row for row in table["rows"]}


async def test_the_tenants_table_and_the_access_log_name_every_tenant(
    fake_engine: FakeEngine, gateway_factory, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [{"key": ALICE, "tenant": "alice"}, {"key": BOB, "tenant": "bob"}]
    overrides = {
        "auth.keys": keys,
        "auth.tenants": {"bob": {"max_in_flight_requests": 1, "tokens_per_day": 100_000}},
        "server.admin_token": ADMIN,
    }
    gw = await gateway_factory([fake_engine.url], overrides=overrides)
    caplog.set_level(logging.INFO, logger="kvgate.access")
    bob, alice = {"x-api-key": BOB}, {"x-api-key": ALICE}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        slow = {**BODY, "fake": {"delay": 1.0}}
        running = asyncio.create_task(client.post("/v1/completions", json=slow, headers=bob))
        assert await eventually(lambda: gw.gateway.security.ledger.held("bob")[1] == 1)
        refused = await client.post("/v1/completions", json=BODY, headers=bob)
        during = (await client.get("/admin/state", headers=admin)).json()
        for _ in range(2):
            assert (await client.post("/v1/completions", json=BODY, headers=alice)).is_success
        assert (await running).is_success
        after = (await client.get("/admin/state", headers=admin)).json()
    assert refused.status_code == 429  # bob's one request in flight is his limit
    assert [c[0] for c in during["tenants"]["columns"]] == [
        "in_flight_requests", "in_flight_tokens", "queued", "refused", "served_tokens",
        "budget_used", "budget_left",
    ]  # fmt: skip
    now = _rows(during)["bob"]
    assert (now["in_flight_requests"], now["refused"], now["served_tokens"]) == (1, 1, 0)
    assert now["in_flight_tokens"] > 10
    # Bob's running request holds its most of his day's budget (its prompt and 10 tokens).
    assert now["in_flight_tokens"] - 2 <= now["budget_used"] <= now["in_flight_tokens"]
    assert now["budget_left"] + now["budget_used"] == 100_000
    rows = _rows(after)
    # The fake engine reports 7 prompt and 5 completion tokens for each answer.
    assert rows["alice"] == {"tenant": "alice", "in_flight_requests": 0, "in_flight_tokens": 0,
                             "queued": 0, "refused": 0, "served_tokens": 24,
                             "budget_used": None, "budget_left": None}  # fmt: skip
    assert (rows["bob"]["in_flight_requests"], rows["bob"]["refused"]) == (0, 1)
    assert rows["bob"]["served_tokens"] == 12
    # Settled with what the engine counted; the refill may have given a little back since.
    assert 0 <= rows["bob"]["budget_used"] <= 12
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    tenants = sorted((line["tenant"], line["status"]) for line in lines)
    assert tenants == [("alice", 200), ("alice", 200), ("bob", 200), ("bob", 429)]
    # kvgate status draws the same table, whatever columns the gateway lists.
    console = status.Console(width=160, record=True)
    console.print(status.render(after))
    text = console.export_text()
    assert "tenants (2)" in text
    heading = next(line for line in text.splitlines() if "served tokens" in line)
    assert [cell.strip() for cell in heading.strip("┃ ").split("┃")] == [
        "tenant", "in flight", "in-flight tokens", "queued", "refused", "served tokens",
        "budget used", "budget left",
    ]  # fmt: skip
    alice_row = next(line for line in text.splitlines() if "│ alice " in line)
    assert [cell.strip() for cell in alice_row.strip("│ ").split("│")] == [
        "alice", "0", "0", "0", "0", "24", "–", "–",
    ]  # fmt: skip


def test_the_table_joins_the_tally_the_cores_usage_and_the_queue() -> None:
    tally = TenantTally()
    tally.finished("a", refused=False, prompt_tokens=100, completion_tokens=20)
    tally.finished("a", refused=True, prompt_tokens=None, completion_tokens=None)
    tally.finished("b", refused=False, prompt_tokens=None, completion_tokens=7)  # a stream
    usage = {"a": {"in_flight_requests": 2, "in_flight_tokens": 900}}
    # Tenant c has a budget per minute and per day: the one with less left is shown.
    windows = {
        "tokens_per_minute": {"limit": 6000, "remaining": 4000},
        "tokens_per_day": {"limit": 100_000, "remaining": 1500},
        "requests_per_minute": {"limit": 10, "remaining": 0},
    }
    table = tenant_table(tally, usage, {"a": 1, "c": 3}, {"c": {"windows": windows}})
    assert table["rows"] == [
        {"tenant": "a", "in_flight_requests": 2, "in_flight_tokens": 900, "queued": 1,
         "refused": 1, "served_tokens": 120, "budget_used": None, "budget_left": None},
        {"tenant": "b", "in_flight_requests": 0, "in_flight_tokens": 0, "queued": 0,
         "refused": 0, "served_tokens": 7, "budget_used": None, "budget_left": None},
        {"tenant": "c", "in_flight_requests": 0, "in_flight_tokens": 0, "queued": 3,
         "refused": 0, "served_tokens": 0, "budget_used": 98_500, "budget_left": 1500},
    ]  # fmt: skip
    assert [tuple(c) for c in table["columns"]] == list(COLUMNS)


async def test_without_keys_every_request_is_one_tenant_without_a_name(
    fake_engine: FakeEngine, gateway_factory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await gateway_factory([fake_engine.url])
    caplog.set_level(logging.INFO, logger="kvgate.access")
    async with httpx.AsyncClient(base_url=gw.url) as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        state = (await client.get("/admin/state")).json()
    assert list(_rows(state)) == [""]
    line = next(orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access")
    assert line["tenant"] is None
    console = status.Console(width=160, record=True)
    console.print(status.render(state))
    assert "(no key)" in console.export_text()
