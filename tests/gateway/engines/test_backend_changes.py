"""Backends change while the gateway runs: `Gateway.set_backends`, `POST /admin/reload`
and SIGHUP (kvgate.gateway.engines.backend_set).

What must hold: an added engine is scraped and routed to at once; a removed one gets no
new request and no more scrapes, while the streams already on it run to their end; a node
whose address changed is polled and served at the new one; a configuration that cannot be
applied changes nothing. The fixtures check that nothing is left in flight.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.helpers import RawClient, kvgate_serve, openai_error, until_ready
from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings
from kvgate.config import load_config
from kvgate.gateway.engines.backend_set import diff_backends
from kvgate.testing import FakeEngine, eventually

TOKEN = "admin-secret"

WAIT_S = 15.0  # generous for a stalling CI machine: a wait ends once its condition holds


def _backend(url: str, name: str | None = None, **extra: Any) -> Backend:
    return Backend.from_settings(BackendSettings(url=url, name=name, **extra))


async def _completion(gateway_url: str, model: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway_url, timeout=5) as client:
        return await client.post("/v1/completions", json={"model": model, "prompt": "hi"})


def _scraped_nodes(gw: Any) -> set[str]:
    return {
        node_id
        for node_id, stats in gw.gateway.scraper.stats().items()
        if stats.last_sample is not None
    }


# ---- the difference ------------------------------------------------------------------------


def test_the_difference_is_taken_by_node_id() -> None:
    a, b, c = (_backend(f"http://127.0.0.1:{port}") for port in (8001, 8002, 8003))
    moved = _backend("http://127.0.0.1:9001", name=a.node_id)
    resized = _backend(a.base_url, engine="tgi", kv_capacity_tokens=1000)
    resized_again = _backend(a.base_url, engine="tgi", kv_capacity_tokens=2000)

    change = diff_backends([a, b], [b, c])
    assert change.as_dict() == {"added": [c.node_id], "removed": [a.node_id], "replaced": []}
    assert change.describe() == f"added {c.node_id}; removed {a.node_id}"

    assert diff_backends([a, b], [_backend(a.base_url), b]).empty  # equal settings, new object
    assert diff_backends([a], [moved]).replaced == ((a, moved),)
    assert diff_backends([resized], [resized_again]).replaced == ((resized, resized_again),)
    assert diff_backends([a], [a]).describe() == "no change"


# ---- through a running gateway -------------------------------------------------------------


async def test_an_added_engine_is_scraped_and_serves_its_model(
    engine_factory, gateway_factory
) -> None:
    first = await engine_factory(model="first")
    second = await engine_factory(model="second")
    gw = await gateway_factory([first.url])
    assert (await _completion(gw.url, "second")).status_code == 404

    change = gw.gateway.set_backends([_backend(first.url), _backend(second.url)])

    assert change.as_dict()["added"] == [f"127.0.0.1:{second.port}"]
    assert await eventually(lambda: len(_scraped_nodes(gw)) == 2, WAIT_S)
    response = await _completion(gw.url, "second")
    assert response.status_code == 200, response.text
    assert len(second.completions()) == 1
    async with httpx.AsyncClient(base_url=gw.url) as client:
        models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
        state = (await client.get("/admin/state")).json()
    assert models == {"first", "second"}
    assert set(state["policy"]["nodes"]) == {b.node_id for b in gw.gateway.backends}
    assert [b["url"] for b in state["gateway"]["backends"]] == [first.url, second.url]


async def test_a_removed_engine_finishes_its_streams_and_gets_nothing_new(
    engine_factory, gateway_factory
) -> None:
    leaving = await engine_factory(model="leaving")
    staying = await engine_factory(model="staying")
    gw = await gateway_factory([leaving.url, staying.url])
    assert await eventually(lambda: len(_scraped_nodes(gw)) == 2, WAIT_S)
    body = {
        "model": "leaving",
        "prompt": "hi",
        "stream": True,
        "fake": {"chunks": 20, "interval": 0.02},
    }
    client = await RawClient.post(gw.url, "/v1/completions", body)
    try:
        await client.read_until(b"data: ")  # the stream is under way on the leaving engine

        gw.gateway.set_backends([_backend(staying.url)])

        count, tail = await client.count_to_end(b"data: ")
    finally:
        client.drop()
    direct = await RawClient.post(leaving.url, "/v1/completions", body)
    try:
        expected, _ = await direct.count_to_end(b"data: ")
    finally:
        direct.drop()
    assert count == expected and b"[DONE]" in tail  # the whole stream, as the engine sends it
    hits = leaving.metrics_hits
    await asyncio.sleep(0.35)  # 3 scrape periods
    assert leaving.metrics_hits == hits, "a removed engine is still scraped"
    assert _scraped_nodes(gw) == {f"127.0.0.1:{staying.port}"}
    refused = await _completion(gw.url, "leaving")
    assert refused.status_code == 404
    assert openai_error(refused.content)["code"] == "model_not_found"
    assert (await _completion(gw.url, "staying")).status_code == 200
    assert len(leaving.completions()) == 2  # the relayed stream and the direct one
    # The relay's kept-alive connection closes when its stream ends, the scraper's at once;
    # only the model catalog's (aiohttp: closed after its 30 s keep-alive) may be left.
    assert await eventually(lambda: len(leaving._handlers) <= 1, WAIT_S), len(leaving._handlers)


async def test_a_node_whose_address_changed_is_served_at_the_new_one(
    engine_factory, gateway_factory
) -> None:
    old = await engine_factory(model="m")
    new = await engine_factory(model="m")
    gw = await gateway_factory([], overrides={"backends": [{"url": old.url, "name": "node-1"}]})
    assert await eventually(lambda: _scraped_nodes(gw) == {"node-1"}, WAIT_S)

    change = gw.gateway.set_backends([_backend(new.url, name="node-1")])

    assert change.as_dict() == {"added": [], "removed": [], "replaced": ["node-1"]}
    assert await eventually(lambda: new.metrics_hits > 0, WAIT_S)
    hits = old.metrics_hits
    assert (await _completion(gw.url, "m")).status_code == 200
    assert len(new.completions()) == 1 and not old.completions()
    await asyncio.sleep(0.35)
    assert old.metrics_hits == hits


async def test_duplicate_node_ids_change_nothing(fake_engine: FakeEngine, gateway_factory) -> None:
    gw = await gateway_factory([fake_engine.url])
    before = list(gw.gateway.backends)
    with pytest.raises(ValueError, match="node id"):
        gw.gateway.set_backends([_backend(fake_engine.url), _backend(fake_engine.url)])
    assert gw.gateway.backends == before


# ---- reloading the configuration -----------------------------------------------------------


def _write_config(path: Path, urls: list[str], **sections: Any) -> None:
    """The settings `gateway_factory` starts with, plus the admin token and `sections`."""
    config: dict[str, Any] = {
        "backends": [{"url": u} for u in urls],
        "server": {"server": "uvicorn", "log_level": "warning", "admin_token": TOKEN},
        "scrape": {"interval_s": 0.1},
    }
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    path.write_text(yaml.safe_dump(config))


async def _reload(gateway_url: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=gateway_url, timeout=5) as client:
        return await client.post("/admin/reload", headers=headers)


async def test_admin_reload_applies_the_file_and_names_what_needs_a_restart(
    engine_factory, gateway_factory, tmp_path: Path
) -> None:
    first = await engine_factory(model="first")
    second = await engine_factory(model="second")
    path = tmp_path / "kvgate.yaml"
    _write_config(path, [first.url])
    gw = await gateway_factory(
        [first.url],
        overrides={"server.admin_token": TOKEN},
        load_config=lambda: load_config(path),
    )

    unchanged = await _reload(gw.url)
    assert unchanged.status_code == 200, unchanged.text
    assert unchanged.json() == {
        "added": [],
        "removed": [],
        "replaced": [],
        "backends": [f"127.0.0.1:{first.port}"],
        "restart_needed": [],
    }

    _write_config(path, [first.url, second.url], scrape={"interval_s": 0.2})
    assert (await _reload(gw.url, token=None)).status_code == 401
    assert (await _reload(gw.url, token="wrong")).status_code == 401
    applied = (await _reload(gw.url)).json()
    assert applied["added"] == [f"127.0.0.1:{second.port}"]
    assert applied["restart_needed"] == ["scrape"]
    assert (await _completion(gw.url, "second")).status_code == 200


@pytest.mark.parametrize(
    "content",
    [
        "backends: [",  # not YAML
        "backends: []\n",  # no backend left
        "backends: [{url: 'ftp://x'}]\n",  # not an engine URL
        "backends: [{url: 'http://127.0.0.1:1'}]\nscrape: {interval_s: 0}\n",  # out of range
    ],
)
async def test_a_configuration_that_cannot_be_applied_changes_nothing(
    fake_engine: FakeEngine, gateway_factory, tmp_path: Path, content: str
) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(content)
    gw = await gateway_factory(
        [fake_engine.url],
        overrides={"server.admin_token": TOKEN},
        load_config=lambda: load_config(path),
    )
    before = list(gw.gateway.backends)
    response = await _reload(gw.url)
    assert response.status_code == 400
    assert openai_error(response.content)["code"] == "invalid_config"
    assert gw.gateway.backends == before
    assert (await _completion(gw.url, "fake-model")).status_code == 200


async def test_reload_needs_a_configuration_and_an_admin_token(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    without_token = await gateway_factory([fake_engine.url])
    response = await _reload(without_token.url)
    assert response.status_code == 403
    assert openai_error(response.content)["code"] == "reload_disabled"
    built_in_code = await gateway_factory(
        [fake_engine.url], overrides={"server.admin_token": TOKEN}
    )
    response = await _reload(built_in_code.url)
    assert response.status_code == 409
    assert openai_error(response.content)["code"] == "reload_unavailable"


@pytest.mark.timeout(60)
async def test_kvgate_serve_applies_a_changed_file_on_sighup(
    engine_factory, tmp_path: Path
) -> None:
    first = await engine_factory(model="first")
    second = await engine_factory(model="second")
    path = tmp_path / "kvgate.yaml"
    info = {"log_level": "info"}  # the reload's outcome is logged at INFO
    _write_config(path, [first.url], server=info)
    async with kvgate_serve("--config", str(path)) as served:
        url = served.url
        admin = {"authorization": f"Bearer {TOKEN}"}  # the file sets an admin token
        async with httpx.AsyncClient(base_url=url, timeout=5, headers=admin) as client:
            assert await until_ready(client), "kvgate serve never became ready"
            assert (await _completion(url, "second")).status_code == 404

            _write_config(path, [second.url], server=info)  # first leaves, second joins
            served.process.send_signal(signal.SIGHUP)

            async def backend_urls() -> list[str]:
                state = (await client.get("/admin/state")).json()
                return [b["url"] for b in state["gateway"]["backends"]]

            deadline = time.monotonic() + WAIT_S
            while (urls := await backend_urls()) != [second.url]:
                assert time.monotonic() < deadline, urls
                await asyncio.sleep(0.05)
            assert (await _completion(url, "second")).status_code == 200

            path.write_text("backends: [")  # a broken file: logged, nothing changes
            served.process.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.3)
            assert (await _completion(url, "second")).status_code == 200
    log = served.stderr.decode()
    assert served.returncode == 0, log
    added, removed = f"127.0.0.1:{second.port}", f"127.0.0.1:{first.port}"
    assert f"backends changed: added {added}; removed {removed}" in log
    assert "reload refused, backends unchanged" in log
    assert "Traceback" not in log


async def test_reload_rotates_api_keys_and_tenant_limits(
    fake_engine: FakeEngine, gateway_factory, tmp_path: Path
) -> None:
    old_key, new_key = "old-key-0123456789", "new-key-0123456789"
    path = tmp_path / "kvgate.yaml"
    keys = [{"key": old_key, "tenant": "team"}]
    _write_config(path, [fake_engine.url], auth={"keys": keys})
    gw = await gateway_factory(
        [fake_engine.url],
        overrides={"server.admin_token": TOKEN, "auth.keys": keys},
        load_config=lambda: load_config(path),
    )

    async def status_with(key: str) -> int:
        async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
            body = {"model": "fake-model", "prompt": "hi"}
            headers = {"authorization": f"Bearer {key}"}
            return (await client.post("/v1/completions", json=body, headers=headers)).status_code

    assert (await status_with(old_key), await status_with(new_key)) == (200, 401)
    auth = {
        "keys": [{"key": new_key, "tenant": "team"}],
        "tenants": {"team": {"max_in_flight_requests": 3}},
    }
    _write_config(path, [fake_engine.url], auth=auth)
    applied = await _reload(gw.url)
    assert applied.status_code == 200, applied.text
    assert applied.json()["restart_needed"] == []
    assert (await status_with(old_key), await status_with(new_key)) == (401, 200)
    tenants = gw.gateway.state()["policy"]["tenants"]
    assert tenants["team"]["max_in_flight_requests"] == 3

    _write_config(path, [fake_engine.url])  # keys off: only a restart may do that
    refused = (await _reload(gw.url)).json()
    assert refused["restart_needed"] == ["auth"]
    assert (await status_with(old_key), await status_with(new_key)) == (401, 200)


async def test_reload_reads_a_rotated_key_file_again(
    fake_engine: FakeEngine, gateway_factory, tmp_path: Path
) -> None:
    """The usual rotation: the key file (a mounted secret) changes, its path does not."""
    key_file = tmp_path / "keys.yaml"
    key_file.write_text(yaml.safe_dump([{"key": "first-key-0123456789", "tenant": "t"}]))
    path = tmp_path / "kvgate.yaml"
    _write_config(path, [fake_engine.url], auth={"key_file": str(key_file)})
    gw = await gateway_factory(
        [fake_engine.url],
        overrides={"server.admin_token": TOKEN, "auth.key_file": str(key_file)},
        load_config=lambda: load_config(path),
    )
    key_file.write_text(yaml.safe_dump([{"key": "second-key-0123456789", "tenant": "t"}]))
    assert (await _reload(gw.url)).json()["restart_needed"] == []
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        body = {"model": "fake-model", "prompt": "hi"}
        for key, status in (("first-key-0123456789", 401), ("second-key-0123456789", 200)):
            headers = {"authorization": f"Bearer {key}"}
            response = await client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == status, key


async def test_streams_survive_backends_changing_under_them(
    engine_factory, gateway_factory
) -> None:
    """Churn: while 16 clients stream without pause, one of three engines is removed and
    added back every 150 ms under the adaptive policy. No request may fail or be cut, and
    the books end at zero (the fixture checks in-flight requests and tickets)."""
    engines = [await engine_factory(model="m") for _ in range(3)]
    gw = await gateway_factory([e.url for e in engines], policy="adaptive")
    assert await eventually(lambda: len(_scraped_nodes(gw)) == 3, WAIT_S)
    every = [_backend(e.url) for e in engines]
    body = {"model": "m", "prompt": "hi", "stream": True, "fake": {"chunks": 10, "interval": 0.01}}
    outcomes: dict[str, int] = {}
    stop = asyncio.Event()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            while not stop.is_set():
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    data = b"".join([chunk async for chunk in response.aiter_raw()])
                reason = response.headers.get("x-kvgate-reason", data[-80:].decode())
                whole = response.status_code == 200 and data.rstrip().endswith(b"[DONE]")
                key = "whole" if whole else f"{response.status_code} {reason}"
                outcomes[key] = outcomes.get(key, 0) + 1

    async def churn() -> int:
        changes = 0
        for turn in range(20):
            await asyncio.sleep(0.15)
            leaving = turn % 3
            gw.gateway.set_backends([b for i, b in enumerate(every) if i != leaving])
            await asyncio.sleep(0.15)
            gw.gateway.set_backends(every)
            changes += 2
        return changes

    clients = [asyncio.create_task(client()) for _ in range(16)]
    try:
        changes = await churn()
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert changes == 40
    # A stall of the machine longer than `stale_after_s` (1 s; seen on CI) leaves every
    # sample stale: the nodes are only late then, and requests wait for the next scrape
    # instead of a 503 (kvgate.core.nodes). Churn itself refuses nothing either.
    assert set(outcomes) == {"whole"}, outcomes
    assert outcomes["whole"] >= 100
    assert all(e.completions() for e in engines)
