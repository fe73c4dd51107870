"""The scraper polls a narrowed page (`/metrics/?name[]=...`) only where it is as good as
the full one, and goes back to the full page when it stops being so.

The fake engine serves the real vLLM page at `/metrics` and, at `/metrics/`, that page cut
to the requested samples, like prometheus_client's exposition app that vLLM mounts there;
each mode of it is one way a real engine can answer the narrowed URL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from adapters.pages import drop_lines, page
from adapters.served import serve_app
from aiohttp import web

from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings, ScrapeSettings
from kvgate.adapters.vllm import VllmAdapter
from kvgate.core.clock import MonotonicClock
from kvgate.core.signals import NodeSample
from kvgate.gateway.engines.scraper import Scraper
from kvgate.sim.metrics import only_samples
from kvgate.testing import eventually

INTERVAL = 0.04
FULL = page("vllm")


@dataclass
class Engine:
    """`narrowed`: how `/metrics/` answers. `filter` (prometheus_client's behaviour),
    `missing` (404: an engine without the mount), `empty` (multi-process mode, whose
    registry cannot be filtered), `no_info` (filters, but lacks the capacity gauge),
    `garbage` (a page without the required metrics)."""

    narrowed: str = "filter"
    paths: list[str] = field(default_factory=list)

    async def full(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        return web.Response(body=FULL, content_type="text/plain")

    async def named(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        names = frozenset(request.query.getall("name[]", []))
        narrowed = only_samples(FULL.decode(), names).encode()
        if self.narrowed == "missing":
            raise web.HTTPNotFound()
        if self.narrowed == "empty":
            narrowed = b""
        elif self.narrowed == "no_info":
            narrowed = drop_lines(narrowed, b"vllm:cache_config_info{")
        elif self.narrowed == "garbage":
            narrowed = b"<html>gateway timeout</html>\n"
        return web.Response(body=narrowed, content_type="text/plain")


class Samples:
    """The scraper's signal sink: every sample, per node."""

    def __init__(self) -> None:
        self.samples: list[NodeSample] = []
        self.failures = 0

    def observe(self, node_id: str, sample: NodeSample) -> None:
        self.samples.append(sample)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        self.failures += 1


@dataclass
class Rig:
    engine: Engine
    backend: Backend
    scraper: Scraper
    sink: Samples

    def page(self) -> str:
        """ "narrowed", "full", or why the full page is polled though a narrowed one exists."""
        stats = self.scraper.stats()[self.backend.node_id]
        return stats.page_note or stats.page


async def _serve(engine: Engine) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", engine.full)
    app.router.add_get("/metrics/", engine.named)
    return await serve_app(app)


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    param = getattr(request, "param", {})
    engine = Engine(narrowed=param.get("narrowed", "filter"))
    runner, url = await _serve(engine)
    metrics_url = url + param.get("metrics_path", "/metrics")
    backend = Backend.from_settings(BackendSettings(url=url, metrics_url=metrics_url))
    settings = ScrapeSettings(interval_s=INTERVAL)
    sink = Samples()
    scraper = Scraper([backend], settings, sink, None, MonotonicClock())
    try:
        yield Rig(engine, backend, scraper, sink)
    finally:
        await scraper.stop()
        await runner.cleanup()


def test_the_narrowed_url_names_every_metric_the_adapter_reads() -> None:
    adapter = VllmAdapter()
    url = adapter.narrowed_metrics_url("http://gpu-1:8000/metrics")
    assert url is not None and url.startswith("http://gpu-1:8000/metrics/?name%5B%5D=")
    narrowed = only_samples(FULL.decode(), frozenset(_names(url))).encode()
    assert adapter.metrics_on(narrowed) == adapter.metrics_on(FULL)
    assert len(narrowed) < len(FULL) / 10
    # A URL that is not a plain metrics page is left alone.
    assert adapter.narrowed_metrics_url("http://gpu-1:8000/metrics?x=1") is None
    assert adapter.narrowed_metrics_url("http://gpu-1:9400/custom") is None


def _names(url: str) -> list[str]:
    from urllib.parse import parse_qs, urlsplit

    return parse_qs(urlsplit(url).query)["name[]"]


async def test_polls_the_narrowed_page_once_it_carries_everything(rig: Rig) -> None:
    async with rig.scraper:
        assert await eventually(lambda: len(rig.sink.samples) >= 5, within=5.0)
    assert rig.page() == "narrowed"
    # The full page until the check (one GET of each page, beside the polls) is done, then
    # only the narrowed page.
    switched = rig.engine.paths.index("/metrics/")
    assert rig.engine.paths[:switched] == ["/metrics"] * switched
    assert rig.engine.paths.count("/metrics/") >= 3
    assert set(rig.engine.paths[-3:]) == {"/metrics/"}
    # The same sample as from the full page.
    full = VllmAdapter().parse(FULL, 0.0)
    got = rig.sink.samples[-1]
    assert (got.kv_usage, got.kv_capacity_tokens, got.running, got.waiting) == (
        full.kv_usage,
        full.kv_capacity_tokens,
        full.running,
        full.waiting,
    )
    assert got.preemptions_total == full.preemptions_total
    assert rig.sink.failures == 0


@pytest.mark.parametrize(
    ("rig", "reason"),
    [
        ({"narrowed": "missing"}, "not checked yet (HTTP 404)"),
        ({"narrowed": "empty"}, "narrowed page carries none of the metrics"),
        ({"narrowed": "no_info"}, "narrowed page lacks vllm:cache_config_info"),
    ],
    indirect=["rig"],
)
async def test_keeps_the_full_page_when_the_narrowed_one_falls_short(rig: Rig, reason: str) -> None:
    async with rig.scraper:
        assert await eventually(lambda: len(rig.sink.samples) >= 5, within=5.0)
    assert rig.page() == reason
    assert rig.engine.paths.count("/metrics/") == 1  # checked again only after 30 s
    assert rig.sink.failures == 0
    assert rig.sink.samples[-1].kv_capacity_tokens == 128 * 32


async def test_goes_back_to_the_full_page_when_the_narrowed_one_goes_bad(rig: Rig) -> None:
    async with rig.scraper:
        assert await eventually(
            lambda: rig.page() == "narrowed" and len(rig.sink.samples) >= 2, within=5.0
        )
        rig.engine.narrowed = "garbage"  # say, another engine version behind the URL
        assert await eventually(lambda: rig.page().startswith("narrowed page unusable"), within=5.0)
        good = len(rig.sink.samples)
        assert await eventually(lambda: len(rig.sink.samples) >= good + 3, within=5.0)
    assert rig.sink.failures == 1  # the one garbage page, then the full page again
    assert rig.engine.paths[-1] == "/metrics"


@pytest.mark.parametrize("rig", [{"metrics_path": "/metrics?page=full"}], indirect=True)
async def test_a_metrics_url_with_a_query_is_polled_as_given(rig: Rig) -> None:
    """The way to keep a node on its full page: vLLM's `/metrics` route ignores the query,
    and kvgate never narrows a URL that has one."""
    async with rig.scraper:
        assert await eventually(lambda: len(rig.sink.samples) >= 3, within=5.0)
    assert set(rig.engine.paths) == {"/metrics"}
    assert rig.page() == "full"
