"""One vocabulary for the errors kvgate writes: a string `code`, the same string in
`X-Kvgate-Reason` and in the access log's `reason`; an engine's own error, a 400
included, is relayed byte for byte without a reason of kvgate's."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from gateway.helpers import openai_error
from kvgate.core.policies.baselines import BaselineOptions
from kvgate.sim.server import SimServer
from kvgate.testing import FakeEngine

TOKEN = "admin-token-of-this-test"


async def test_every_error_kvgate_writes_names_its_code_in_x_kvgate_reason(
    fake_engine: FakeEngine,
    sim_server: SimServer,
    refused_url: str,
    gateway_factory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gw = await gateway_factory(
        [fake_engine.url, f"http://127.0.0.1:{sim_server.port}"],
        overrides={"server.admin_token": TOKEN, "limits.max_body_bytes": 4096},
    )
    lonely = await gateway_factory([refused_url])
    limited = await gateway_factory(
        [fake_engine.url],
        policy="static-qps",
        baseline=BaselineOptions(qps=0.001, burst=1),
    )
    await gw.gateway.catalog.refresh()
    caplog.set_level(logging.INFO, logger="kvgate.access")
    chat = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        answers = {
            "invalid_json": await client.post("/v1/completions", content=b"{nope"),
            "invalid_request": await client.post("/v1/completions", json={"prompt": "p"}),
            "invalid_priority": await client.post(
                "/v1/completions", json=chat, headers={"X-Kvgate-Priority": "urgent"}
            ),
            "model_not_found": await client.post("/v1/completions", json={**chat, "model": "x"}),
            "context_length_exceeded": await client.post(
                "/v1/chat/completions", json={**chat, "max_tokens": 3000}
            ),
            "request_too_large": await client.post(
                "/v1/completions", json={**chat, "prompt": "p" * 5000}
            ),
            "not_found": await client.get("/nowhere"),
            "method_not_allowed": await client.put("/v1/models"),
            "invalid_admin_token": await client.get("/admin/state"),
            "no_backend": await client.post(
                lonely.url + "/v1/completions", json={**chat, "model": "fake-model"}
            ),
        }
        fake = {**chat, "model": "fake-model"}
        assert (await client.post(limited.url + "/v1/completions", json=fake)).status_code == 200
        answers["qps_limit"] = await client.post(limited.url + "/v1/completions", json=fake)
    for code, response in answers.items():
        assert response.headers.get("x-kvgate-reason") == code, (code, response.text)
        error = openai_error(response.content)
        assert error["code"] == code and isinstance(error["code"], str)
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
    relayed = {line["reason"] for line in lines if line["status"] >= 400}
    assert {"invalid_json", "context_length_exceeded", "no_backend", "qps_limit"} <= relayed


async def test_an_engines_own_400_is_relayed_as_it_sent_it(
    fake_engine: FakeEngine, gateway_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """kvgate did not decide it: the engine's body, byte for byte, and no reason of
    kvgate's in the header or the access log."""
    gw = await gateway_factory([fake_engine.url])
    caplog.set_level(logging.INFO, logger="kvgate.access")
    body = {"model": "fake-model", "prompt": "p", "fake": {"status": 400}}
    async with httpx.AsyncClient() as client:
        direct = await client.post(fake_engine.url + "/v1/completions", json=body)
        relayed = await client.post(gw.url + "/v1/completions", json=body)
    assert relayed.status_code == direct.status_code == 400
    assert relayed.content == direct.content
    assert relayed.json()["error"]["code"] == 400  # the engine's vocabulary, not kvgate's
    assert "x-kvgate-reason" not in relayed.headers
    line = next(orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access")
    assert (line["status"], line["reason"]) == (400, None)
