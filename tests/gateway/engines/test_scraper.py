"""The scraper against real HTTP servers on 127.0.0.1 that serve a real vLLM page and can be
switched to garbage, a hang, an HTTP error, a slow answer or silence; the real admission
policy listens."""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
import pytest
from adapters.pages import page, replace_line
from adapters.served import serve_app
from aiohttp import web

from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings, ScrapeSettings
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.baselines import build_named
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.gateway.engines.scrape_http import LeanHttpFetcher
from kvgate.gateway.engines.scraper import HANG_FACTOR, Scraper, poll_period

INTERVAL = 0.04
STALE_AFTER = 0.2  # the rig's: polls hang after 5 x 0.2 = 1 s
REAL_PAGE = page("vllm")


class Engine:
    """A fake engine's /metrics, served over real HTTP, whose behaviour tests switch."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay = 0.0  # seconds before each answer ("ok" mode)
        self.hits = 0
        self.times: list[float] = []  # time.monotonic() of each hit
        self.itl_count = 1000
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.times.append(time.monotonic())
        self.auth.append(request.headers.get("Authorization"))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.mode == "hang":
            await asyncio.sleep(30)
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        if self.mode == "garbage":
            return web.Response(body=b"<html>upstream connect error</html>")
        if self.mode == "nan":
            return web.Response(
                body=replace_line(
                    REAL_PAGE, b"vllm:kv_cache_usage_perc{", b"vllm:kv_cache_usage_perc NaN"
                )
            )
        # "ok": a real page whose inter-token histogram advances 10 tokens of 20 ms per scrape
        self.itl_count += 10
        body = replace_line(
            REAL_PAGE,
            b"vllm:inter_token_latency_seconds_count{",
            f'vllm:inter_token_latency_seconds_count{{engine="0"}} {self.itl_count}'.encode(),
        )
        body = replace_line(
            body,
            b"vllm:inter_token_latency_seconds_sum{",
            f'vllm:inter_token_latency_seconds_sum{{engine="0"}} {self.itl_count * 0.02}'.encode(),
        )
        return web.Response(body=body, content_type="text/plain")


async def _serve(engine: Engine) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    return await serve_app(app)


class Recorder:
    """Forwards to the real policy and remembers what it was told."""

    def __init__(self, policy: BasePolicy) -> None:
        self.policy = policy
        self.samples: list[tuple[str, NodeSample]] = []
        self.arrived: list[float] = []  # time.monotonic() at each sample
        self.failures: list[tuple[str, bool]] = []  # (node, hard)

    def observe(self, node_id: str, sample: NodeSample) -> None:
        self.samples.append((node_id, sample))
        self.arrived.append(time.monotonic())
        self.policy.observe(node_id, sample)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        self.failures.append((node_id, hard))
        self.policy.observe_failure(node_id, hard)

    def fresh(self, node_id: str) -> bool:
        node = self.policy.nodes.get(node_id)
        return node is not None and node.is_fresh(self.policy.clock.now(), self.policy.settings)

    def state(self, node_id: str) -> str:
        node = self.policy.nodes[node_id]
        return node.state(self.policy.clock.now(), self.policy.settings)


class Rig:
    def __init__(self, engines: list[Engine], urls: list[str], scraper: Scraper, rec: Recorder):
        self.engines, self.urls, self.scraper, self.rec = engines, urls, scraper, rec
        self.ids = [b.node_id for b in scraper.backends]


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    param = getattr(request, "param", {})
    n, stale_after = param.get("n", 1), param.get("stale_after", STALE_AFTER)
    engines = [Engine() for _ in range(n)]
    served = [await _serve(e) for e in engines]
    clock = MonotonicClock()
    settings = AdmissionSettings(stale_after_s=stale_after).tuned(failures_to_stale=3)
    policy = build_named("none", settings, clock)
    assert isinstance(policy, BasePolicy)
    rec = Recorder(policy)
    backends = [
        Backend.from_settings(BackendSettings(url=url, api_key="k" if i == 0 else None))
        for i, (_, url) in enumerate(served)
    ]
    scrape = ScrapeSettings(interval_s=INTERVAL)
    scraper = Scraper(backends, scrape, rec, None, clock, stale_after_s=stale_after)
    try:
        yield Rig(engines, [u for _, u in served], scraper, rec)
    finally:
        await scraper.stop()
        for runner, _ in served:
            await runner.cleanup()


def _clock_tick() -> float:
    """The monotonic clock's step on this machine, measured: the smallest change seen."""
    tick = float("inf")
    for _ in range(20):
        start = time.monotonic()
        while (now := time.monotonic()) == start:
            pass
        tick = min(tick, now - start)
    return tick


async def _until(predicate: Any, within: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


async def test_healthy_node_is_fresh_with_real_samples(rig: Rig) -> None:
    node = rig.ids[0]
    async with rig.scraper:
        await _until(lambda: len(rig.rec.samples) >= 4)
        assert rig.rec.fresh(node)
    stats = rig.scraper.stats()[node]
    assert stats.up is True and stats.failures_total == 0 and stats.last_error is None
    sample = rig.scraper.last_sample(node)
    # Its GET's own duration: within the sample's age when it arrived (a loaded machine's
    # loopback GET can outlast the interval: that is no failure), give or take one tick of
    # the monotonic clock (a VM's can be several ms: a quick GET then reads 0).
    (_, last), arrived = rig.rec.samples[-1], rig.rec.arrived[-1]
    assert stats.last_latency_s is not None
    tick = _clock_tick()
    assert 0 <= stats.last_latency_s <= arrived - last.sampled_at + tick + 0.001
    assert sample is not None and sample.kv_capacity_tokens == 4096
    assert sample.iteration_latency_s == pytest.approx(0.02)  # from the histogram deltas
    assert rig.engines[0].auth[0] == "Bearer k"  # the backend's key goes to its own engine
    snap = orjson.loads(orjson.dumps(rig.scraper.snapshot()))
    assert snap["nodes"][node]["last_sample"]["kv_capacity_tokens"] == 4096


async def test_polls_at_the_configured_period(rig: Rig) -> None:
    times = rig.engines[0].times
    async with rig.scraper:
        started = time.monotonic()
        await _until(lambda: len(times) >= 12, within=10.0)
        elapsed = time.monotonic() - started
    # Never faster than the period: one poll per period, plus the one at the start.
    assert len(times) <= elapsed / INTERVAL + 2
    # At the period: the median gap. A stall of a loaded machine lengthens one gap (the
    # scraper never bursts to catch up), so it moves the median no more than one poll.
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert INTERVAL * 0.75 <= statistics.median(gaps) <= INTERVAL * 1.5, gaps


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("garbage", "required metric missing"),
        ("500", "HTTP 500"),
        ("nan", "not finite"),
    ],
)
async def test_bad_answers_make_the_node_dead_and_are_logged_once(
    rig: Rig, mode: str, error: str, caplog: pytest.LogCaptureFixture
) -> None:
    node = rig.ids[0]
    caplog.set_level(logging.INFO, logger="kvgate.gateway.engines.scraper")
    async with rig.scraper:
        await _until(lambda: rig.rec.fresh(node))
        rig.engines[0].mode = mode
        caplog.clear()  # a blip before the switch (busy machine) would be logged too: skip it
        await _until(lambda: rig.scraper.stats()[node].consecutive_failures >= 5)
        assert not rig.rec.fresh(node) and rig.rec.state(node) == "dead"
        assert all(hard for _, hard in rig.rec.failures)
        stats = rig.scraper.stats()[node]
        assert stats.up is False and error in (stats.last_error or "")
        rig.engines[0].mode = "ok"
        await _until(lambda: rig.rec.fresh(node))
    assert rig.scraper.stats()[node].consecutive_failures == 0
    down = [r for r in caplog.records if "scrape failed" in r.getMessage()]
    back = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert len(down) == 1 and down[0].levelno == logging.WARNING
    assert len(back) == 1
    assert "k" not in down[0].getMessage().split()  # no secrets in logs


async def test_a_hanging_page_is_abandoned_at_its_bound_as_a_failure_that_is_not_hard(
    rig: Rig,
) -> None:
    node = rig.ids[0]
    hang_after = HANG_FACTOR * STALE_AFTER
    assert rig.scraper.hang_after_s == pytest.approx(hang_after)
    async with rig.scraper:
        await _until(lambda: rig.rec.fresh(node))
        rig.engines[0].mode = "hang"
        await _until(lambda: rig.scraper.stats()[node].in_flight_since is not None)
        # Stale by the sample's age long before the poll is given up: never dead.
        await _until(lambda: rig.rec.state(node) == "stale")
        assert rig.scraper.snapshot()["nodes"][node]["in_flight_s"] > 0
        await _until(lambda: rig.rec.failures, within=hang_after * 3)
        assert rig.rec.failures[0] == (node, False)
        stats = rig.scraper.stats()[node]
        assert stats.last_latency_s is not None and stats.last_latency_s >= hang_after * 0.99
        assert "hung" in (stats.last_error or "")
        assert rig.rec.state(node) == "stale"
        rig.engines[0].mode = "ok"
        await _until(lambda: rig.rec.fresh(node), within=hang_after * 3)


@pytest.mark.parametrize("rig", [{"stale_after": 0.4}], indirect=True)
async def test_a_page_that_keeps_turning_slow_is_told_at_info_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """On a loaded host an idle engine's page turns slow and quick again every few seconds:
    the first slow spell is an INFO line (and its end), the others in the next 10 minutes
    are DEBUG."""
    engine, node = rig.engines[0], rig.ids[0]
    caplog.set_level(logging.DEBUG, logger="kvgate.gateway.engines.scraper")
    async with rig.scraper:
        for _ in range(3):
            engine.delay = 0.2  # twice the 0.1 s line (a quarter of stale_after)
            await _until(lambda: rig.scraper.stats()[node].slow)
            engine.delay = 0.0
            await _until(lambda: not rig.scraper.stats()[node].slow)
    speed = [r for r in caplog.records if "metrics page" in r.getMessage()]
    slow = [r for r in speed if "took" in r.getMessage()]
    quick = [r for r in speed if "quick again" in r.getMessage()]
    assert len(slow) >= 3 and len(quick) >= 3  # a busy test machine may add spells
    assert [r.levelno for r in slow].count(logging.INFO) == 1 and slow[0].levelno == logging.INFO
    assert "a busy engine" in slow[0].getMessage()
    assert [r.levelno for r in quick].count(logging.INFO) == 1 and quick[0].levelno == logging.INFO


class CountingFetcher(LeanHttpFetcher):
    """The scraper's own fetcher, counting the GETs it has open at once."""

    def __init__(self) -> None:
        super().__init__()
        self.open = self.most_open = 0

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            return await super().get(url, headers)
        finally:
            self.open -= 1


def _counted(rig: Rig) -> tuple[Scraper, CountingFetcher]:
    """A scraper of the rig's engines whose fetcher counts its open GETs."""
    fetcher = CountingFetcher()
    scrape = ScrapeSettings(interval_s=INTERVAL)
    clock = rig.rec.policy.clock
    scraper = Scraper(
        rig.scraper.backends, scrape, rig.rec, fetcher, clock, stale_after_s=STALE_AFTER
    )
    return scraper, fetcher


async def test_a_poll_out_for_stale_after_is_hedged_and_a_page_back_is_read_at_once(
    rig: Rig,
) -> None:
    """While the page hangs, a GET starts every `stale_after_s` beside the first one (never
    more than the two at once); the first page after the hang comes from such a hedge,
    within one `stale_after_s`, long before the first GET's hang bound."""
    node, engine = rig.ids[0], rig.engines[0]
    scraper, fetcher = _counted(rig)
    try:
        async with scraper:
            await _until(lambda: rig.rec.fresh(node))
            engine.mode = "hang"  # every GET asked from now on is lost (30 s)
            hung_at = time.monotonic()
            await _until(lambda: scraper.stats()[node].hedges_total >= 3)
            engine.mode = "ok"
            back_at = time.monotonic()
            count = len(rig.rec.samples)
            await _until(lambda: len(rig.rec.samples) > count)
            answered_after = rig.rec.arrived[count] - back_at
    finally:
        await fetcher.close()
    assert fetcher.most_open == 2  # the first GET and one hedge: a newer one replaced it
    hits = [t for t in engine.times if t >= hung_at]
    gaps = [later - earlier for earlier, later in itertools.pairwise(hits)]
    assert max(gaps) < 2 * STALE_AFTER, gaps  # a new GET each stale_after_s, not each hang
    assert answered_after < 2 * STALE_AFTER < HANG_FACTOR * STALE_AFTER, answered_after
    assert rig.rec.failures == []  # back before the first GET's bound: nothing failed


async def test_a_page_slower_than_stale_after_is_answered_by_its_first_get(rig: Rig) -> None:
    """A hedge does not replace the first GET: a page that takes longer than
    `stale_after_s` is still a sample, stamped when its first GET was sent."""
    node, engine = rig.ids[0], rig.engines[0]
    engine.delay = 1.5 * STALE_AFTER  # the hedge sent at stale_after would answer later
    scraper, fetcher = _counted(rig)
    try:
        async with scraper:
            await _until(lambda: len(rig.rec.samples) >= 4, within=10.0)
    finally:
        await fetcher.close()
    assert rig.rec.failures == []
    assert scraper.stats()[node].hedges_total >= 3 and fetcher.most_open == 2
    for (_, sample), arrived in zip(rig.rec.samples[1:], rig.rec.arrived[1:], strict=True):
        assert arrived - sample.sampled_at >= engine.delay  # the first GET's page, not a hedge's


@pytest.mark.parametrize("rig", [{"stale_after": 1.0}], indirect=True)
async def test_a_slow_page_is_a_sample_stamped_when_it_was_asked(rig: Rig) -> None:
    """A page slower than the interval is waited for (never two polls at once), kept, and
    stamped with the time its GET was sent; polls back off and come back to the interval
    when the page is quick again."""
    engine, node = rig.engines[0], rig.ids[0]
    delay = engine.delay = 0.06  # 1.5 intervals: polled every 2 x 0.06 s
    async with rig.scraper:
        await _until(lambda: len(rig.rec.samples) >= 6, within=10.0)
        assert rig.rec.failures == []
        assert engine.most_in_flight == 1
        for (_, sample), arrived in zip(rig.rec.samples[1:], rig.rec.arrived[1:], strict=True):
            sent = max(t for t in engine.times if t <= arrived)  # the hit this sample answers
            assert sample.sampled_at <= sent < sample.sampled_at + 0.05
            assert arrived - sample.sampled_at >= delay
        period = rig.scraper.stats()[node].period_s
        assert period == pytest.approx(poll_period(INTERVAL, delay, 1.0), rel=0.3)
        slow_gaps = [b - a for a, b in itertools.pairwise(engine.times[-4:])]
        assert statistics.median(slow_gaps) >= 2 * delay * 0.9, slow_gaps  # backed off
        engine.delay = 0.0
        count = len(engine.times)
        await _until(lambda: len(engine.times) >= count + 12, within=10.0)
        quick_gaps = [b - a for a, b in itertools.pairwise(engine.times[-8:])]
        assert statistics.median(quick_gaps) <= INTERVAL * 1.5, quick_gaps
    assert rig.scraper.stats()[node].period_s == pytest.approx(INTERVAL)


def test_poll_period_backs_off_within_the_staleness_budget() -> None:
    assert poll_period(0.05, 0.004, 1.0) == 0.05  # a quick page: the interval
    assert poll_period(0.05, 0.1, 1.0) == pytest.approx(0.2)  # twice its duration
    assert poll_period(0.05, 0.4, 1.0) == pytest.approx(0.25)  # capped: back to back
    assert poll_period(0.05, 3.4, 1.0) == pytest.approx(0.25)
    assert poll_period(0.5, 0.3, 1.0) == 0.5  # never faster than the interval


@pytest.mark.parametrize("rig", [{"n": 2}], indirect=True)
async def test_a_hanging_node_does_not_slow_the_others(rig: Rig) -> None:
    rig.engines[1].mode = "hang"
    healthy, hanging = rig.ids

    def sampled() -> int:
        return sum(1 for node, _ in rig.rec.samples if node == healthy)

    async with rig.scraper:
        # Counted, not timed: a stall of a loaded machine delays both nodes alike.
        await _until(
            lambda: sampled() >= 7 and rig.scraper.stats()[hanging].failures_total >= 1,
            within=10.0,
        )
        assert rig.rec.fresh(healthy) and not rig.rec.fresh(hanging)
    # The healthy node kept its period while the other one's polls hung.
    gaps = [b - a for a, b in itertools.pairwise(rig.engines[0].times)]
    assert statistics.median(gaps) <= INTERVAL * 1.5, gaps


async def test_a_node_nobody_listens_on() -> None:
    clock = MonotonicClock()
    policy = build_named("none", AdmissionSettings().tuned(failures_to_stale=3), clock)
    assert isinstance(policy, BasePolicy)
    rec = Recorder(policy)
    backend = Backend.from_settings(BackendSettings(url="http://127.0.0.1:9"))
    scraper = Scraper([backend], ScrapeSettings(interval_s=INTERVAL), rec, None, clock)
    async with scraper:
        await _until(lambda: len(rec.failures) >= 3)
    assert rec.samples == []
    assert all(hard for _, hard in rec.failures)  # refused: hard
    assert not rec.fresh(backend.node_id)  # never heard from: never fresh
    assert rec.state(backend.node_id) == "dead"
    assert "connect" in (scraper.stats()[backend.node_id].last_error or "").lower()


async def test_stopping_leaves_no_task_behind(rig: Rig) -> None:
    before = asyncio.all_tasks()
    task = asyncio.create_task(rig.scraper.run())
    await _until(lambda: len(rig.rec.samples) >= 2)
    rig.engines[0].mode = "hang"  # cancel while a poll is in flight
    await asyncio.sleep(INTERVAL * 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    left = [t for t in asyncio.all_tasks() - before if "scraper" in _where(t)]
    assert left == []
    assert rig.engines[0].hits >= 3  # it was polling when it was cancelled


def _where(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None)
    return f"{task.get_name()} {code.co_filename if code else ''}"


async def test_a_policy_bug_does_not_stop_scraping(rig: Rig) -> None:
    calls = []

    def broken(node_id: str, sample: NodeSample) -> None:
        calls.append(node_id)
        raise RuntimeError("bug")

    rig.rec.observe = broken  # type: ignore[method-assign]
    async with rig.scraper:
        await _until(lambda: len(calls) >= 3)
    assert rig.scraper.stats()[rig.ids[0]].up is True


async def test_closes_the_client_it_made_and_not_one_it_was_given(rig: Rig) -> None:
    sink = Recorder.__new__(Recorder)
    clock = MonotonicClock()
    given = LeanHttpFetcher()
    backend = Backend.from_settings(BackendSettings(url=rig.urls[0]))
    borrowed = Scraper([backend], ScrapeSettings(), sink, given, clock)
    assert borrowed.fetcher is given
    body = await given.get(backend.metrics_url, {})
    assert body.startswith(b"# SOURCE")
    own = Scraper([], ScrapeSettings(), sink, None, clock)
    assert isinstance(own.fetcher, LeanHttpFetcher)
    for scraper in (borrowed, own):
        async with scraper:  # run() waits for backends to be added: stopped from outside
            await asyncio.sleep(0.01)
    again = await given.get(backend.metrics_url, {})  # still open: the caller closes it
    assert again.startswith(b"# SOURCE")
    await given.close()
