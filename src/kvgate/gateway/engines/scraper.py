"""The scraper: polls every engine's metrics page and feeds the admission policy.

One task per backend, all owned by one `asyncio.TaskGroup` inside `Scraper.run()`, so
cancelling `run()` stops every poll and nothing outlives it. The same group owns the
one-off checks of each node's narrowed page (`NarrowablePage`), which run beside its
polls.

**Polls are sized to the engine, not to the interval.** A busy engine renders its page
slowly (vLLM serves it from the API server that streams the tokens), and a slow page is
still a good sample: a poll in flight is never abandoned for being slower than the
interval, the next poll waits for it, and the sample is stamped with the time its GET was
*sent*, so the core judges it by its true age. When pages are slow, polls back off
(`poll_period`) and return to the interval when they are fast again. Only a page that
hangs past `HANG_FACTOR` x `stale_after_s` is abandoned: that is a failure, but not a
*hard* one (refused or reset connection, HTTP error, unparseable page), so slowness alone
never makes a node stale before its sample's age does (`kvgate.core.nodes`).

**Polls are hedged.** A GET out for `stale_after_s` may be slow or may be lost (a page
that hung and answers new requests again, a connection the engine dropped): one more GET
starts beside it, and again each `stale_after_s` while no page has come, with at most one
such hedge in flight (a newer one replaces it). The first page to arrive ends the poll and
the other GET is cancelled. So a page that comes back is read within one `stale_after_s`,
and a slow one is still waited for.

Failures are logged once when the node goes down and once when it comes back, a slow
page once when it turns slow and once when it recovers, never per poll.

Start/stop from an ASGI lifespan::

    scraper = Scraper(backends, config.scrape, policy, None, clock)
    async with scraper:          # starts run() in a task
        ...                      # serve
    # leaving the block cancels and awaits it

or own the task yourself: `task = asyncio.create_task(scraper.run())`, later
`task.cancel()` and `await` it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.adapters.backend import Backend
from kvgate.adapters.base import MetricsParseError, NarrowablePage
from kvgate.adapters.settings import ScrapeSettings
from kvgate.core.clock import Clock
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample, SignalSink
from kvgate.gateway.engines.scrape_http import LeanHttpFetcher, MetricsFetcher, ScrapeError
from kvgate.gateway.engines.scrape_stats import NodeStats, describe

log = logging.getLogger(__name__)

# A poll still unanswered after this many `stale_after_s` (5 s by default) has hung: it is
# abandoned and its connection closed. Longer than any page a busy engine was seen to
# render (the real vLLM's stalled 1.75-3.4 s under load); by then the node is stale anyway
# unless the gateway sees its tokens flow.
HANG_FACTOR = 5.0
# Slow pages: the next poll starts this many times the last one's duration after it
# began, so that polling takes at most half of a slow engine's page-rendering time...
BACKOFF_FACTOR = 2.0
# ...but never later than this share of `stale_after_s` after it: a slow page is still
# asked often enough for its samples to stay fresh (a 0.4 s page is polled back to back,
# its sample at most ~0.8 s old when the next one arrives).
BACKOFF_CAP_SHARE = 0.25
_RECHECK_AFTER_S = 30.0  # a check that could not decide, or a narrowed page gone bad
# A node's page turning slow (and quick again) is logged at INFO at most once in this long,
# and at DEBUG in between: on a loaded host even an idle engine's page crosses the line
# every few seconds (64 INFO lines in 10 minutes, measured), which says nothing new.
SPEED_NOTE_EVERY_S = 600.0
_STALE_AFTER_S: float = AdmissionSettings.model_fields["stale_after_s"].default


_EXPECTED_FAILURES = (
    MetricsParseError,
    ScrapeError,
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
    TimeoutError,
    OSError,
)


def poll_period(interval_s: float, duration_s: float, stale_after_s: float) -> float:
    """Seconds from the start of a poll that took `duration_s` to the start of the next
    (which never starts before the last one ended: polls do not overlap)."""
    backed_off = min(BACKOFF_FACTOR * duration_s, BACKOFF_CAP_SHARE * stale_after_s)
    return max(interval_s, backed_off)


@dataclass(slots=True, frozen=True)
class _Get:
    """One GET of a poll: when it was sent (the core's clock, the sample's stamp), when it
    started (loop time) and the task that fetches the page. Only the page that ends the
    poll is parsed: an adapter's state (histogram deltas) sees one page per poll, in order."""

    sent_at: float
    started: float
    task: asyncio.Task[bytes]

    def answered(self) -> bool:
        """Done with a page (not a failure)."""
        return self.task.done() and not self.task.cancelled() and self.task.exception() is None


class Scraper:
    """Polls each backend's metrics about every `settings.interval_s` and feeds `policy`.

    Pages are fetched by `fetcher` when one is given (tests, benchmarks), else by the
    scraper's own keep-alive client (`LeanHttpFetcher`), closed when `run()` ends.
    `clock` stamps the samples on the core's time base; `stale_after_s` is the core's
    (`admission.stale_after_s`): it sizes the hang bound, the hedges and the back-off.
    `polls(node_id)`, when given, is asked before each poll: False skips it (a replica of a
    cluster skips the engines another replica polls for it, see kvgate.cluster.sync).
    """

    def __init__(
        self,
        backends: Sequence[Backend],
        settings: ScrapeSettings,
        policy: SignalSink,
        fetcher: MetricsFetcher | None,
        clock: Clock,
        *,
        stale_after_s: float = _STALE_AFTER_S,
        polls: Callable[[str], bool] | None = None,
    ) -> None:
        ids = [b.node_id for b in backends]
        if len(set(ids)) != len(ids):
            raise ValueError("backend node ids must be unique")
        self._backends = list(backends)
        self._interval = settings.interval_s
        self._stale_after = stale_after_s
        self._hang_after = HANG_FACTOR * stale_after_s
        self._policy = policy
        self._owns_fetcher = fetcher is None
        self._fetcher: MetricsFetcher = LeanHttpFetcher() if fetcher is None else fetcher
        self._clock = clock
        self._polls = polls
        self._stats: dict[str, NodeStats] = {}
        # Nodes whose adapter can ask for a narrowed page: node id -> its URL. Which page
        # a node is polled on is decided by `_check_narrowed_page`, node by node.
        self._narrowed: dict[str, str] = {}
        for b in self._backends:
            self._track(b)
        self._check_due: dict[str, float] = {}  # node id -> loop time of its next check
        self._group: asyncio.TaskGroup | None = None  # run()'s: one task per node
        self._node_tasks: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def _track(self, backend: Backend) -> None:
        self._stats[backend.node_id] = NodeStats(
            backend.node_id, backend.engine, backend.metrics_url, period_s=self._interval
        )
        if isinstance(backend.adapter, NarrowablePage):
            url = backend.adapter.narrowed_metrics_url(backend.metrics_url)
            if url is not None:
                self._narrowed[backend.node_id] = url

    # ---- changing the backends while running -------------------------------------------

    def add(self, backend: Backend) -> None:
        """Watch one more backend; polled at once if the scraper is running."""
        if backend.node_id in self._stats:
            raise ValueError(f"node {backend.node_id!r} is already watched")
        self._backends.append(backend)
        self._track(backend)
        if self._group is not None:
            self._start(self._group, backend, 0.0)

    def remove(self, node_id: str) -> None:
        """Stop watching `node_id`: its poll and any check in progress are cancelled now,
        before anything else runs, so the policy hears nothing more of it."""
        task = self._node_tasks.pop(node_id, None)
        if task is not None:
            task.cancel()
        urls = [b.metrics_url for b in self._backends if b.node_id == node_id]
        self._backends = [b for b in self._backends if b.node_id != node_id]
        self._stats.pop(node_id, None)
        narrowed = self._narrowed.pop(node_id, None)
        if narrowed is not None:
            urls.append(narrowed)
        self._check_due.pop(node_id, None)
        for url in urls:
            self._fetcher.forget(url)  # its kept-alive connection, if idle

    # ---- reading ---------------------------------------------------------------------

    @property
    def interval_s(self) -> float:
        return self._interval

    @property
    def hang_after_s(self) -> float:
        """A poll unanswered this long is abandoned (a failure, not a hard one)."""
        return self._hang_after

    @property
    def fetcher(self) -> MetricsFetcher:
        return self._fetcher

    @property
    def backends(self) -> Sequence[Backend]:
        return tuple(self._backends)

    def stats(self) -> Mapping[str, NodeStats]:
        """Live per-node stats (do not mutate): latency, failures, last error, last sample."""
        return self._stats

    def last_sample(self, node_id: str) -> NodeSample | None:
        return self._stats[node_id].last_sample

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for `/admin/state`."""
        now = self._clock.now()
        return {
            "interval_s": self._interval,
            "hang_after_s": self._hang_after,
            "nodes": {nid: s.as_dict(now) for nid, s in self._stats.items()},
        }

    # ---- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Scrape until cancelled. Start times are spread over one period so that many
        nodes do not all fire in the same millisecond."""
        n = len(self._backends)
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for i, backend in enumerate(self._backends):
                    self._start(group, backend, self._interval * i / n)
                # Kept open with no node left, so that a backend added later is watched.
                await asyncio.Event().wait()
        finally:
            self._group = None
            self._node_tasks.clear()
            if self._owns_fetcher:
                await self._fetcher.close()

    def _start(self, group: asyncio.TaskGroup, backend: Backend, offset: float) -> None:
        node_id = backend.node_id
        task = group.create_task(self._node(backend, offset), name=f"scrape {node_id}")
        self._node_tasks[node_id] = task
        task.add_done_callback(lambda done: self._forget_task(node_id, done))

    def _forget_task(self, node_id: str, task: asyncio.Task[None]) -> None:
        if self._node_tasks.get(node_id) is task:
            del self._node_tasks[node_id]

    async def _node(self, backend: Backend, offset: float) -> None:
        """One node's polls and checks, in a group of its own: removing the node cancels
        both at once."""
        async with asyncio.TaskGroup() as checks:
            await self._watch(backend, offset, checks)

    async def __aenter__(self) -> Scraper:
        if self._task is not None:
            raise RuntimeError("scraper already started")
        self._task = asyncio.create_task(self.run(), name="kvgate scraper")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Cancel `run()` started by `async with` and wait until every poll has ended."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _watch(self, backend: Backend, offset: float, checks: asyncio.TaskGroup) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + offset
        if backend.node_id in self._narrowed:
            self._check_due[backend.node_id] = next_at
        stats = self._stats[backend.node_id]
        while True:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._polls is not None and not self._polls(backend.node_id):
                next_at += self._interval  # another replica polls it and shares its samples
                continue
            due = self._check_due.get(backend.node_id)
            if due is not None and loop.time() >= due:
                # Beside the polls, which go on with the full page meanwhile: a slow check
                # must not leave the node without samples.
                del self._check_due[backend.node_id]
                checks.create_task(
                    self._check_narrowed_page(backend), name=f"check {backend.node_id}"
                )
            started = loop.time()
            await self.scrape_once(backend)
            ended = loop.time()
            # The page's speed is the answering GET's (a hedge's, after a hang).
            took = ended - started if stats.last_latency_s is None else stats.last_latency_s
            stats.period_s = poll_period(self._interval, took, self._stale_after)
            self._note_speed(backend, stats, took)
            # Anchored on the schedule while polls are quick (a steady period); a poll that
            # overran its slot is followed at once, never by a burst of missed ticks.
            next_at = max(next_at + stats.period_s, ended)

    def _note_speed(self, backend: Backend, stats: NodeStats, duration: float) -> None:
        """Log when a node's page turns slow enough to be polled back to back, and when it
        is quick again (at half that time: no flapping at the edge): at INFO for the first
        slow spell in `SPEED_NOTE_EVERY_S`, at DEBUG for the others."""
        threshold = max(self._interval, BACKOFF_CAP_SHARE * self._stale_after)
        if stats.slow:
            threshold /= 2
        slow = duration >= threshold
        if slow == stats.slow or stats.up is False:
            return
        stats.slow = slow
        if not slow:
            log.log(
                logging.INFO if stats.slow_told else logging.DEBUG,
                "node %s: metrics page quick again (%.0f ms)",
                backend.node_id,
                duration * 1000,
            )
            return
        now = time.monotonic()
        told_at = stats.slow_told_at
        stats.slow_told = told_at is None or now - told_at >= SPEED_NOTE_EVERY_S
        if not stats.slow_told:
            stats.slow_spells_untold += 1
            log.debug("node %s: metrics page took %.0f ms", backend.node_id, duration * 1000)
            return
        untold, stats.slow_spells_untold, stats.slow_told_at = stats.slow_spells_untold, 0, now
        log.info(
            "node %s: metrics page took %.0f ms (a busy engine); polled back to back,"
            " its samples lag%s",
            backend.node_id,
            duration * 1000,
            f" (slow {untold} more times since the last such line)" if untold else "",
        )

    async def scrape_once(self, backend: Backend) -> NodeSample | None:
        """One poll of one backend: fetch, parse, tell the policy, update stats.

        Hedged: while no page has come, one more GET starts each time the newest one has
        been out `stale_after_s`, beside the first (at most one such hedge in flight: a
        newer one replaces it). The first page to arrive is the poll's sample and the
        other GET is cancelled, so a page that hung and answers again is read within one
        `stale_after_s`, while a slow page is still waited for up to `hang_after_s`. A
        hedge that fails only frees its place; the first GET's failure is the poll's.
        """
        stats = self._stats[backend.node_id]
        stats.scrapes_total += 1
        first = self._send(backend)
        stats.in_flight_since = first.sent_at
        hedge: _Get | None = None
        hedge_at = first.started + self._stale_after
        try:
            while True:
                gets = {first.task} if hedge is None else {first.task, hedge.task}
                timeout = max(0.0, hedge_at - asyncio.get_running_loop().time())
                done, _ = await asyncio.wait(
                    gets, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if hedge is not None and hedge.task in done:
                    if hedge.answered():
                        return self._settle(backend, stats, hedge)
                    hedge.task.exception()  # retrieved: a failed hedge only frees its place
                    hedge = None
                if first.task in done:
                    return self._settle(backend, stats, first)
                if not done:
                    if hedge is not None:
                        hedge.task.cancel()
                    hedge = self._send(backend)
                    stats.hedges_total += 1
                    hedge_at = hedge.started + self._stale_after
        finally:
            stats.in_flight_since = None
            left = [get.task for get in (first, hedge) if get is not None]
            for task in left:
                task.cancel()  # a GET that lost (or every GET, when the poll is cancelled)
            # Cancelled GETs end at once: cancellation closes their connections.
            await asyncio.gather(*left, return_exceptions=True)

    def _send(self, backend: Backend) -> _Get:
        """Start one GET of the node's page, stamped with the time it is sent."""
        sent_at = self._clock.now()
        task = asyncio.get_running_loop().create_task(
            self._fetch(backend), name=f"scrape GET {backend.node_id}"
        )
        return _Get(sent_at, asyncio.get_running_loop().time(), task)

    def _settle(self, backend: Backend, stats: NodeStats, get: _Get) -> NodeSample | None:
        """Record the outcome of the GET that ends the poll."""
        latency = asyncio.get_running_loop().time() - get.started
        exc = get.task.exception()
        if exc is None:
            try:
                sample = backend.adapter.parse(get.task.result(), get.sent_at)
            except Exception as parse_error:
                exc = parse_error
            else:
                self._record_success(backend, stats, sample, latency)
                return sample
        if isinstance(exc, MetricsParseError) and stats.page == "narrowed":
            # The engine behind the URL changed (another version, another mode): back to
            # the full page, and check the narrowed one again later.
            self._use_full_page(backend, f"narrowed page unusable ({exc})")
        elif not isinstance(exc, _EXPECTED_FAILURES):
            # A bug in an adapter must not stop the other nodes.
            log.error("scraper: unexpected error on %s", backend.node_id, exc_info=exc)
        self._record_failure(backend, stats, exc, latency)
        return None

    async def _fetch(self, backend: Backend) -> bytes:
        async with asyncio.timeout(self._hang_after):
            url = self._stats[backend.node_id].metrics_url
            return await self._fetcher.get(url, backend.auth_headers())

    # ---- the narrowed page -------------------------------------------------------------

    async def _check_narrowed_page(self, backend: Backend) -> None:
        """Poll the narrowed page from now on if it carries every metric the full page does.

        Two GETs, in a task of their own beside the node's polls and outside their
        statistics. If either fails the node stays on the full page and is checked again
        later.
        """
        node_id = backend.node_id
        adapter = backend.adapter
        assert isinstance(adapter, NarrowablePage)
        narrowed_url = self._narrowed[node_id]
        headers = backend.auth_headers()
        stats = self._stats[node_id]
        try:
            async with asyncio.timeout(self._hang_after):  # two GETs of a possibly busy page
                narrowed = adapter.metrics_on(await self._fetcher.get(narrowed_url, headers))
                full = adapter.metrics_on(await self._fetcher.get(backend.metrics_url, headers))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure only means: no decision yet
            reason = describe(exc, self._hang_after)
            self._use_full_page(backend, f"not checked yet ({reason})")
            return
        if not narrowed:
            self._use_full_page(backend, "narrowed page carries none of the metrics")
            return
        if missing := sorted(full - narrowed):
            self._use_full_page(backend, f"narrowed page lacks {', '.join(missing)}")
            return
        stats.metrics_url, stats.page, stats.page_note = narrowed_url, "narrowed", None
        log.info(
            "node %s: polling only the %d metrics kvgate reads (%s?name[]=...)",
            node_id,
            len(narrowed),
            narrowed_url.split("?", 1)[0],
        )

    def _use_full_page(self, backend: Backend, reason: str) -> None:
        stats = self._stats[backend.node_id]
        if stats.page_note != reason:
            log.info("node %s: polling the full metrics page: %s", backend.node_id, reason)
        stats.metrics_url, stats.page, stats.page_note = backend.metrics_url, "full", reason
        self._check_due[backend.node_id] = asyncio.get_running_loop().time() + _RECHECK_AFTER_S

    # ---- bookkeeping -------------------------------------------------------------------

    def _record_success(
        self, backend: Backend, stats: NodeStats, sample: NodeSample, latency: float
    ) -> None:
        stats._observe_latency(latency)
        stats.last_success_at = sample.sampled_at
        stats.last_sample = sample
        if stats.up is False:
            log.info(
                "node %s recovered after %d failed scrapes",
                backend.node_id,
                stats.consecutive_failures,
            )
        stats.up = True
        stats.consecutive_failures = 0
        stats.last_error = None
        self._tell(backend.node_id, sample)

    def _record_failure(
        self, backend: Backend, stats: NodeStats, exc: BaseException, latency: float
    ) -> None:
        reason = describe(exc, self._hang_after)
        stats._observe_latency(latency)
        stats.failures_total += 1
        stats.consecutive_failures += 1
        stats.last_error = reason
        if stats.up is not False:
            log.warning(
                "node %s: metrics scrape failed (%s); it gets no samples until it recovers",
                backend.node_id,
                reason,
            )
        stats.up = False
        # A hang is slowness taken to its bound, not a refusal: the core lets the sample's
        # age decide (see kvgate.core.nodes).
        self._tell(backend.node_id, None, hard=not isinstance(exc, TimeoutError))

    def _tell(self, node_id: str, sample: NodeSample | None, hard: bool = True) -> None:
        try:
            if sample is None:
                self._policy.observe_failure(node_id, hard)
            else:
                self._policy.observe(node_id, sample)
        except Exception:  # the policy is pure code: a bug there must not kill scraping
            log.exception(
                "scraper: policy rejected a %s for %s",
                "failure" if sample is None else "sample",
                node_id,
            )
