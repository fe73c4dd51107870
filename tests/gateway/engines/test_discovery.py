"""Engines found by DNS (`discover: dns`, kvgate.gateway.engines.discovery).

The engines, sockets and gateway are real. Where a test needs the set of addresses to
change, it passes the gateway a resolver it controls (a stand-in for the cluster's DNS,
which a test cannot edit); the system resolver itself is used for `localhost`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kvgate.adapters.settings import BackendSettings
from kvgate.gateway.engines import discovery
from kvgate.gateway.engines.discovery import Discovery, at_address, resolve_ipv4
from kvgate.testing import FakeEngine, eventually, free_port

WAIT_S = 15.0  # generous for a stalling CI machine: a wait ends once its condition holds


class Addresses:
    """A resolver whose answer the test sets; `None` makes the lookup fail."""

    def __init__(self, *addresses: str) -> None:
        self.answer: list[str] | None = list(addresses)
        self.lookups = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        if self.answer is None:
            raise OSError(f"{host}: Name or service not known")
        return sorted(self.answer)


def _dns(url: str, **extra: Any) -> BackendSettings:
    return BackendSettings(url=url, discover="dns", **extra)


def test_each_address_is_one_backend_named_after_the_entry() -> None:
    entry = _dns(
        "http://vllm.ns.svc:8000/prefix",
        name="vllm",
        metrics_url="http://vllm.ns.svc:8001/metrics",
        api_key="engine-key",
    )
    backend = at_address(entry, "10.0.0.7")
    assert backend.node_id == "vllm@10.0.0.7:8000"
    assert backend.base_url == "http://10.0.0.7:8000/prefix"
    assert backend.metrics_url == "http://10.0.0.7:8001/metrics"
    assert backend.api_key == "engine-key"
    unnamed = at_address(_dns("http://vllm.ns.svc"), "10.0.0.8")
    assert unnamed.node_id == "vllm.ns.svc@10.0.0.8:80"


def test_discovery_needs_plain_http() -> None:
    with pytest.raises(ValidationError, match="http://"):
        _dns("https://vllm.ns.svc:8443")


async def test_a_failed_or_empty_lookup_keeps_the_last_addresses() -> None:
    resolver = Addresses("10.0.0.1", "10.0.0.2")
    static = BackendSettings(url="http://10.9.9.9:8000")
    discovery = Discovery([static, _dns("http://svc:8000")], resolver)
    assert [b.node_id for b in discovery.backends()] == ["10.9.9.9:8000"]
    assert await discovery.refresh()
    expected = ["10.9.9.9:8000", "svc@10.0.0.1:8000", "svc@10.0.0.2:8000"]
    assert [b.node_id for b in discovery.backends()] == expected
    assert not await discovery.refresh()  # the same answer: no change
    resolver.answer = None
    assert not await discovery.refresh()
    resolver.answer = []
    assert not await discovery.refresh()
    assert [b.node_id for b in discovery.backends()] == expected
    # A reload with the same entry starts from what it knew, not from nothing.
    again = Discovery([_dns("http://svc:8000")], resolver, previous=discovery)
    assert [b.node_id for b in again.backends()] == expected[1:]


async def test_the_system_resolver_finds_localhost() -> None:
    assert "127.0.0.1" in await resolve_ipv4("localhost", 80)


async def test_a_gateway_serves_the_engines_a_name_resolves_to(gateway_factory) -> None:
    """`localhost` through the system resolver: the engine behind it is scraped and served."""
    engine = await FakeEngine().start()
    try:
        backends = [{"url": f"http://localhost:{engine.port}", "discover": "dns"}]
        gw = await gateway_factory([], overrides={"backends": backends})
        assert [b.node_id for b in gw.gateway.backends] == [f"localhost@127.0.0.1:{engine.port}"]
        async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
            response = await client.post(
                "/v1/completions", json={"model": "fake-model", "prompt": "hi"}
            )
        assert response.status_code == 200
        assert len(engine.completions()) == 1
    finally:
        await engine.stop()


async def _quiet(engine: FakeEngine, period_s: Callable[[], float]) -> int:
    """The engine's metrics hits once none came for three poll periods (`period_s()`: the
    period the scraper uses now, longer on a loaded machine); fails if it is still being
    polled after WAIT_S."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    last = engine.metrics_hits
    while True:
        await asyncio.sleep(3 * period_s())
        if engine.metrics_hits == last:
            return last
        assert asyncio.get_running_loop().time() < deadline, "still scraped"
        last = engine.metrics_hits


async def test_pods_that_come_and_go_are_added_and_removed(gateway_factory, monkeypatch) -> None:
    monkeypatch.setattr(discovery, "DISCOVER_EVERY_S", 0.5)  # the test's pace, not Kubernetes'
    port = free_port()
    pods = [await FakeEngine(host=f"127.0.0.{i}", port=port).start() for i in (1, 2)]
    try:
        resolver = Addresses("127.0.0.1")
        backends = [{"url": f"http://pods:{port}", "discover": "dns"}]
        gw = await gateway_factory([], overrides={"backends": backends}, resolver=resolver)
        assert [b.node_id for b in gw.gateway.backends] == [f"pods@127.0.0.1:{port}"]

        resolver.answer = ["127.0.0.1", "127.0.0.2"]  # a second pod became ready
        assert await eventually(lambda: len(gw.gateway.backends) == 2, WAIT_S)
        assert await eventually(lambda: pods[1].metrics_hits > 0, WAIT_S)

        resolver.answer = ["127.0.0.2"]  # the first one went away
        assert await eventually(lambda: len(gw.gateway.backends) == 1, WAIT_S)
        # A GET sent just before the removal may still arrive: the pod is left alone once
        # no hit comes for three scrape intervals, where a scraped pod gets three.
        kept = f"pods@127.0.0.2:{port}"

        def period() -> float:  # the kept pod's: what a pod still scraped would get
            return max(0.1, gw.gateway.scraper.stats()[kept].period_s)

        hits = await _quiet(pods[0], period)
        async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
            for _ in range(3):
                response = await client.post(
                    "/v1/completions", json={"model": "fake-model", "prompt": "hi"}
                )
                assert response.status_code == 200
        assert len(pods[1].completions()) == 3
        assert await _quiet(pods[0], period) == hits, "a pod that left is still scraped"

        resolver.answer = None  # DNS fails: the known pod stays
        lookups = resolver.lookups
        assert await eventually(lambda: resolver.lookups > lookups + 1, WAIT_S)
        assert [b.node_id for b in gw.gateway.backends] == [f"pods@127.0.0.2:{port}"]
    finally:
        for pod in pods:
            await pod.stop()


async def test_a_name_added_by_a_reload_is_looked_up_at_once(
    fake_engine: FakeEngine, gateway_factory, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from kvgate.config import load_config

    monkeypatch.setattr(discovery, "DISCOVER_EVERY_S", 300.0)  # only the reload looks it up

    port = free_port()
    pod = await FakeEngine(host="127.0.0.3", port=port).start()
    try:
        path = tmp_path / "kvgate.yaml"
        resolver = Addresses("127.0.0.3")
        gw = await gateway_factory(
            [fake_engine.url],
            overrides={"server.admin_token": "t"},
            resolver=resolver,
            load_config=lambda: load_config(path),
        )
        path.write_text(
            f"backends: ['{fake_engine.url}', {{url: 'http://pods:{port}', discover: dns}}]\n"
            "server: {admin_token: t}\n"
        )
        gw.gateway.reload()
        expected = [f"127.0.0.1:{fake_engine.port}", f"pods@127.0.0.3:{port}"]
        assert await eventually(
            lambda: [b.node_id for b in gw.gateway.backends] == expected, WAIT_S
        )
        assert await eventually(lambda: pod.metrics_hits > 0, WAIT_S)
    finally:
        await pod.stop()
