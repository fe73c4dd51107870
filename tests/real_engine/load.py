"""Traffic for the real-engine tests: the overload burst and the three disconnect paths.

The same functions drive the engine directly and through kvgate, so the two runs differ
only in the URL they are given.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from real_engine.engine import (
    MODEL_NAME,
    EngineMetrics,
    MetricsRecorder,
    exact_prompt,
    poll,
    poll_until,
    read_metrics,
    watch_until,
)

# ---------------------------------------------------------------------------------------
# Overload burst
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    status: int
    latency_s: float
    retry_after: str | None
    completion_tokens: int | None
    # Of a refusal: `X-Kvgate-Reason`, `retry-after-ms` and the body's `error` object
    # (None when the body was not JSON with one).
    reason: str | None = None
    retry_after_ms: str | None = None
    error: dict[str, Any] | None = None


@dataclass
class BurstResult:
    outcomes: list[Outcome]
    samples: list[EngineMetrics]
    preemptions: float  # growth of vllm:num_preemptions_total over the burst
    wall_s: float
    label: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    @property
    def shed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 429]

    def median_admitted_latency(self) -> float:
        return statistics.median(o.latency_s for o in self.admitted)

    def summary(self) -> str:
        statuses: dict[int, int] = {}
        for outcome in self.outcomes:
            statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
        text = f"statuses {dict(sorted(statuses.items()))}, preemptions +{self.preemptions:g}"
        refused = sorted({o.reason or "-" for o in self.outcomes if o.status != 200})
        if refused:
            text += f" (refused: {', '.join(refused)})"
        if self.admitted:
            text += f", median latency of admitted {self.median_admitted_latency():.2f} s"
        if self.samples:
            # How many pages arrived and the slowest GET say how much the peaks can be
            # trusted: one CI run's polls saw a peak of 1 running during a 16-request burst.
            text += (
                f", peak KV {max(s.kv_usage for s in self.samples):.2f}"
                f", peak running {max(s.running for s in self.samples):g}"
                f", peak waiting {max(s.waiting for s in self.samples):g}"
                f" ({len(self.samples)} pages, slowest GET"
                f" {max(s.took for s in self.samples) * 1000:.0f} ms)"
            )
        return text + f", wall {self.wall_s:.1f} s"


async def _one_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, object],
    headers: dict[str, str] | None = None,
) -> Outcome:
    started = time.monotonic()
    response = await client.post(url + "/v1/completions", json=body, headers=headers)
    latency = time.monotonic() - started
    if response.status_code == 200:
        tokens = int(response.json()["usage"]["completion_tokens"])
        return Outcome(200, latency, None, tokens)
    error = None
    with contextlib.suppress(ValueError):
        data = response.json()
        found = data.get("error") if isinstance(data, dict) else None
        error = found if isinstance(found, dict) else None
    return Outcome(
        response.status_code,
        latency,
        response.headers.get("retry-after"),
        None,
        response.headers.get("x-kvgate-reason"),
        response.headers.get("retry-after-ms"),
        error,
    )


def _any_page(_: EngineMetrics) -> bool:
    """For poll_until: the first page that arrives (a GET that fails is retried)."""
    return True


async def burst(
    target_url: str,
    engine_url: str,
    prompt: str,
    n: int,
    max_tokens: int,
    timeout_s: float = 110.0,
) -> BurstResult:
    """Send `n` identical long requests at once; watch the engine's metrics meanwhile."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    # The metrics page is read on its own client: a burst lasts longer than uvicorn's 5 s
    # keep-alive, so a pooled connection reused afterwards can meet the server's close.
    async with httpx.AsyncClient(timeout=10.0) as probe:
        before = await poll_until(probe, engine_url, _any_page, timeout_s=60.0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        started = time.monotonic()
        async with MetricsRecorder(engine_url) as recorder:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(_one_completion(client, target_url, body) for _ in range(n))),
                timeout_s,
            )
        wall = time.monotonic() - started
    async with httpx.AsyncClient(timeout=10.0) as probe:
        after = await poll_until(probe, engine_url, _any_page, timeout_s=60.0)
    return BurstResult(
        list(outcomes), recorder.samples, after.preemptions_total - before.preemptions_total, wall
    )


# ---------------------------------------------------------------------------------------
# Overload through kvgate's queue
# ---------------------------------------------------------------------------------------

# The overload bursts are sheddable: kvgate never plans sheddable work above the cache,
# whatever the engine's measured cost of a preemption (`kvgate.core.plan.ceiling`), so they
# wait in its queue on any engine.
SHEDDABLE = {"X-Kvgate-Priority": "sheddable"}
NO_WAIT = {**SHEDDABLE, "X-Kvgate-Max-Wait-Ms": "0"}  # a client that wants a decision at once


@dataclass
class QueuedBurst:
    """An overload burst through kvgate, and impatient clients sent while it waited."""

    burst: BurstResult  # the patient requests (no header) and the engine's pages meanwhile
    impatient: list[Outcome]  # `X-Kvgate-Max-Wait-Ms: 0`, each sent while others waited
    waiting_seen: list[int]  # kvgate's queue length just before each impatient client
    queue: dict[str, Any]  # kvgate's `policy.queue` from /admin/state after the burst

    def summary(self) -> str:
        counters = self.queue.get("counters") or {}
        waited = int(counters.get("admitted_after_wait", 0))
        mean = float(self.queue.get("wait_total_s", 0.0)) / waited if waited else 0.0
        statuses = sorted(o.status for o in self.impatient)
        return (
            f"{self.burst.summary()}; kvgate queued {int(counters.get('queued', 0))},"
            f" started after waiting {waited} (mean wait {mean:.1f} s),"
            f" {sorted((k, v) for k, v in counters.items() if k.startswith('refused'))};"
            f" impatient clients {statuses} with Retry-After"
            f" {[o.retry_after for o in self.impatient]} while {self.waiting_seen} waited"
        )


async def kvgate_queue(client: httpx.AsyncClient, gateway_url: str) -> dict[str, Any]:
    """kvgate's queue as /admin/state shows it (`policy.queue`)."""
    response = await client.get(gateway_url + "/admin/state")
    response.raise_for_status()
    queue = response.json()["policy"]["queue"]
    assert isinstance(queue, dict), queue
    return queue


async def queued_burst(
    gateway_url: str,
    engine_url: str,
    prompt: str,
    n: int,
    max_tokens: int,
    impatient: int,
    timeout_s: float = 110.0,
) -> QueuedBurst:
    """`n` identical long requests at once through kvgate; once its queue holds half of
    them, up to `impatient` more that will not wait, one each time the queue's length has
    changed (while it is not empty). The engine's metrics page is recorded throughout."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(timeout=10.0) as probe:
        before = await poll_until(probe, engine_url, _any_page, timeout_s=60.0)
    async with (
        httpx.AsyncClient(timeout=timeout_s, limits=limits) as client,
        httpx.AsyncClient(timeout=10.0) as admin,
    ):
        started = time.monotonic()
        async with MetricsRecorder(engine_url) as recorder:
            patient = [
                asyncio.create_task(_one_completion(client, gateway_url, body, SHEDDABLE))
                for _ in range(n)
            ]
            try:
                # Half the burst waiting in kvgate (or a request already answered: the
                # assertions then say what went wrong).
                await poll(
                    lambda: kvgate_queue(admin, gateway_url),
                    lambda q: int(q["waiting"]) >= n // 2 or any(t.done() for t in patient),
                    timeout_s=30.0,
                )
                refused, seen = await _impatient(client, admin, gateway_url, body, impatient)
                outcomes = await asyncio.wait_for(asyncio.gather(*patient), timeout_s)
            finally:
                for task in patient:
                    task.cancel()
                await asyncio.gather(*patient, return_exceptions=True)
        wall = time.monotonic() - started
        queue = await kvgate_queue(admin, gateway_url)
    async with httpx.AsyncClient(timeout=10.0) as probe:
        after = await poll_until(probe, engine_url, _any_page, timeout_s=60.0)
    preempted = after.preemptions_total - before.preemptions_total
    result = BurstResult(list(outcomes), recorder.samples, preempted, wall)
    return QueuedBurst(result, refused, seen, queue)


async def _impatient(
    client: httpx.AsyncClient,
    admin: httpx.AsyncClient,
    gateway_url: str,
    body: dict[str, object],
    count: int,
) -> tuple[list[Outcome], list[int]]:
    """Send up to `count` requests with `X-Kvgate-Max-Wait-Ms: 0`, one after another, each
    only while kvgate's queue holds others (a request that arrives behind waiters may not
    pass them). Each is answered in milliseconds, so all of them meet the queue at any
    engine speed. `seen` is the queue's length each met."""
    outcomes: list[Outcome] = []
    seen: list[int] = []
    while len(outcomes) < count:
        waiting = int((await kvgate_queue(admin, gateway_url))["waiting"])
        if not waiting:
            break
        seen.append(waiting)
        outcomes.append(await _one_completion(client, gateway_url, body, NO_WAIT))
    return outcomes, seen


# ---------------------------------------------------------------------------------------
# Disconnects
# ---------------------------------------------------------------------------------------


# serve.sh's max_model_len (2048) less a short prompt's tokens: an answer as long as the
# engine gives, so that a request is still running when a slow page or a busy host lets
# the test act on it (1,500 tokens ended first on a machine 4x faster than this one).
LONGEST_OUTPUT = 2040


@dataclass(frozen=True)
class Disconnect:
    """How long after the client hung up the engine's metrics showed the request gone."""

    gone_after_s: float
    polls: int
    chunks_before: int  # SSE data lines the client had received before it hung up
    last: EngineMetrics


GoneCondition = Callable[[EngineMetrics], bool]


class ResponseEndedFirst(AssertionError):
    """The answer was complete before the engine showed the state to hang up in."""


async def measure_disconnect(
    target_url: str,
    engine_url: str,
    body: dict[str, object],
    *,
    path: str = "/v1/completions",
    ready: GoneCondition | None,
    gone: GoneCondition,
    chunks_first: int = 0,
    ready_timeout_s: float = 30.0,
    gone_timeout_s: float = 5.0,
) -> Disconnect:
    """Send one request, hang up once it is where it should be, then time until `gone`.

    Where it should be: `chunks_first` SSE lines received (mid-stream: tokens are the
    engine's own proof that it runs the request, at any speed), then, if `ready` is
    given, a page of the engine showing `ready` (queued, or non-streaming: no token says
    where the request is). The client is a task reading the response; cancelling it
    closes its connection (an httpx connection cancelled mid-request is closed, never
    pooled). The clock starts before the cancel; a metrics GET starts every ~10 ms
    (overlapping when slow) and the figure is the arrival of the first page showing the
    request gone: an upper bound.
    """
    first_chunks = asyncio.Event()
    chunks = 0

    async def client_side() -> None:
        nonlocal chunks
        async with (
            httpx.AsyncClient(timeout=120.0) as client,
            client.stream("POST", target_url + path, json=body) as response,
        ):
            assert response.status_code == 200, (response.status_code, await response.aread())
            async for line in response.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks += 1
                    if chunks >= chunks_first:
                        first_chunks.set()
        page: EngineMetrics | str = "unread (the GET failed)"
        async with httpx.AsyncClient(timeout=10.0) as probe:
            with contextlib.suppress(httpx.TransportError):
                page = await read_metrics(probe, engine_url)
        raise ResponseEndedFirst(
            f"the response ended before the client hung up ({chunks} SSE lines);"
            f" the engine's page now: {page}"
        )

    async with httpx.AsyncClient(timeout=10.0) as poller:
        task = asyncio.create_task(client_side())
        try:
            if chunks_first:
                await _first_of(task, first_chunks.wait(), ready_timeout_s)
            if ready is not None:
                await _first_of(
                    task, poll_until(poller, engine_url, ready, ready_timeout_s), ready_timeout_s
                )
            sent_chunks = chunks
            hung_up_at = time.monotonic()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            last, polls = await watch_until(poller, engine_url, gone, gone_timeout_s)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return Disconnect(last.at - hung_up_at, polls, sent_chunks, last)


async def _first_of(task: asyncio.Task[None], waiter: object, timeout_s: float) -> None:
    """Await `waiter`, but surface the client task's failure (e.g. a 429) at once."""
    wait_task = asyncio.ensure_future(waiter)  # type: ignore[arg-type]
    done, _ = await asyncio.wait(
        {task, wait_task}, timeout=timeout_s, return_when="FIRST_COMPLETED"
    )
    if task in done:
        wait_task.cancel()
        task.result()  # raises the client's error
        raise AssertionError("the client finished before the engine reached the wanted state")
    if wait_task not in done:
        wait_task.cancel()
        raise TimeoutError(f"engine not in the wanted state after {timeout_s} s")
    wait_task.result()


GONE_BOUND_S = 0.1  # the target: the engine shows a disconnected request gone within 100 ms
ATTEMPTS = 5  # see disconnect_attempts


def gone_in_time(result: Disconnect) -> bool:
    """The engine showed the request gone on a page asked for within GONE_BOUND_S.

    The figure itself runs to the page's arrival, so it holds the GET's own time, which
    is the machine's and not kvgate's: 5-20 ms on a quiet fast machine, 80-190 ms on a
    slow CI machine while the engine runs two long requests (where the first page asked
    for 25 ms after the hang-up showed the request gone). A request that lingers is
    still shown on every page asked for after the bound.
    """
    return result.gone_after_s - result.last.took < GONE_BOUND_S


async def disconnect_attempts(
    measure: Callable[[], Awaitable[Disconnect]], attempts: int = ATTEMPTS
) -> list[Disconnect]:
    """Measure up to `attempts` times, stopping at the first `gone_in_time`.

    On 2 shared cores a concurrent build can stall the engine's API server for a few
    hundred ms, and the metrics GET that would show the request gone with it (measured:
    100-500 ms per GET at a load average of 15-20, 5-20 ms on a quiet machine). A retry
    tells that noise apart from a request that really lingers, which fails every attempt.
    Every attempt is kept for the figures.
    """
    results: list[Disconnect] = []
    missed: list[str] = []
    for _ in range(attempts):
        try:
            results.append(await measure())
        except (ResponseEndedFirst, TimeoutError, httpx.TimeoutException) as exc:
            # The engine's page never showed the wanted state before the answer was done
            # (seen once in CI), or not within the poll's time (with a busy loop taking one
            # of the two cores, vLLM's API server updated its page seconds late), or a
            # request timed out (one CI run saw a 10 s connect timeout while the machine
            # stalled): no disconnect was measured, so try again. A request that really
            # lingers fails every attempt.
            missed.append(f"{type(exc).__name__}: {exc}")
            continue
        if gone_in_time(results[-1]):
            break
    if not results:
        raise AssertionError(f"no attempt reached the point of hanging up: {missed}")
    return results


def describe(results: list[Disconnect]) -> str:
    """'23 ms (4 polls, last took 6 ms)', for every attempt.

    The figure is an upper bound: the time until the first page showing the request gone
    ARRIVED. How long that GET took says how coarse the bound is on this machine.
    """
    return ", ".join(
        f"{r.gone_after_s * 1000:.0f} ms ({r.polls} polls, last took {r.last.took * 1000:.0f} ms)"
        for r in results
    )


# ---------------------------------------------------------------------------------------
# A full engine
# ---------------------------------------------------------------------------------------

# Two fillers of 1,040 prompt tokens hold 66 of the 127 usable KV blocks from their prefill
# on, and grow to 126 (1,040 + 976 tokens = 63 blocks each): never a preemption, and never
# the 63 free blocks that a 2,000-token prompt needs, so such a request waits in the
# engine's queue for as long as the fillers run (976 decode steps: about the longest two
# requests that never preempt can take on this engine). Two
# streams keep the engine's API server responsive, so its metrics page stays a fine clock
# (32 slot-fillers made each GET take 140-200 ms).
FILLERS = 2
FILLER_PROMPT_TOKENS = 1040
FILLER_MAX_TOKENS = 976
BLOCKED_PROMPT_TOKENS = 2000  # a prompt that cannot be scheduled while the fillers run


# The fillers' prompts take 66 blocks, and each adds a block per 32 tokens it generates. A
# page showing at most 101 blocks taken is early: at least 400 of the 976 decode steps
# remain, so a request queued behind the fillers stays visibly queued. A slow poll on a
# loaded machine may first see the fillers later than that, when they have only
# milliseconds left; such a filling is started again rather than handed out, except the
# last one. (Even an early page can be stale when vLLM's API server lags under load, so
# callers still treat "the queued request was never seen queued" as a missed attempt.)
FULL_FROM = 65.5 / 127  # 66 blocks, below any rounding
EARLY_UNTIL = 101.5 / 127  # 101 blocks
FILLING_ATTEMPTS = 3


@contextlib.asynccontextmanager
async def full_kv_cache(engine_url: str) -> AsyncIterator[EngineMetrics]:
    """Fill the engine's KV cache with long requests sent straight to it.

    Yields a page showing both fillers running with their prompts in the cache, early in
    their run; on exit the fillers are aborted (their clients hang up) and the engine is
    idle again. Raises `ResponseEndedFirst` (a missed attempt, for the caller to retry) if
    no page showed the fillers filling the cache before they were done, every time.
    """
    async with (
        httpx.AsyncClient(timeout=120.0) as client,
        httpx.AsyncClient(timeout=10.0) as poller,  # its own pool, free while fillers run
    ):
        # The engine idle first: what an earlier test left running (a stream whose abort
        # is still on its way) would end under the fillers and leave room they do not fill.
        await poll_until(
            poller, engine_url, lambda m: m.running == 0 and m.waiting == 0, timeout_s=60.0
        )
        filler = {
            "model": MODEL_NAME,
            "prompt": await exact_prompt(poller, engine_url, FILLER_PROMPT_TOKENS),
            "max_tokens": FILLER_MAX_TOKENS,
            "ignore_eos": True,
        }
        for attempt in range(FILLING_ATTEMPTS):
            fillers = [
                asyncio.create_task(client.post(engine_url + "/v1/completions", json=filler))
                for _ in range(FILLERS)
            ]
            try:
                full = await _first_full_page(poller, engine_url, fillers)
                if full is not None and (
                    full.kv_usage <= EARLY_UNTIL or attempt == FILLING_ATTEMPTS - 1
                ):
                    yield full
                    return
            finally:
                await _stop_fillers(poller, engine_url, fillers)
        raise ResponseEndedFirst(
            f"{FILLING_ATTEMPTS} fillings ran out before a page showed them filling the cache"
        )


async def _first_full_page(
    poller: httpx.AsyncClient, engine_url: str, fillers: list[asyncio.Task[httpx.Response]]
) -> EngineMetrics | None:
    """The first page showing the fillers in the cache; None if they were done first (vLLM's
    API server can update its page too late to show them, on a loaded machine)."""

    def filling(m: EngineMetrics) -> bool:
        return m.running == FILLERS and m.waiting == 0 and m.kv_usage >= FULL_FROM

    page = await poll_until(
        poller,
        engine_url,
        lambda m: filling(m) or all(task.done() for task in fillers),
        timeout_s=60.0,
    )
    return page if filling(page) else None


async def _stop_fillers(
    poller: httpx.AsyncClient, engine_url: str, fillers: list[asyncio.Task[httpx.Response]]
) -> None:
    """Hang up on the fillers and wait until the engine has dropped them."""
    for task in fillers:
        task.cancel()
    await asyncio.gather(*fillers, return_exceptions=True)
    await poll_until(
        poller,
        engine_url,
        lambda m: m.running == 0 and m.waiting == 0,
        timeout_s=60.0,
        interval_s=0.05,
    )
