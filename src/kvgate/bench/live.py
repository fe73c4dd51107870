"""A real HTTP load generator with real client behaviour, and the processes it talks to.

Each user request is an asyncio task that sends streaming `/v1/completions` with a token-id
prompt (exact length on every engine) and `ignore_eos`, so the work asked for is the same
whatever the engine. The client behaves as in the virtual runs (`ClientModel`): when its
deadline passes it closes the connection (a real disconnect the engine or gateway sees);
a timeout or 5xx is retried; a 429 waits out `Retry-After`; after N tries it gives up.
While the run goes, every engine's `/metrics` is polled to record the time series.

Clients count the tokens they read exactly (`return_token_ids`, a vLLM extension other
engines ignore): vLLM merges several tokens into one event when its server lags, so
counting events undercounts what a client that leaves early had read. On an engine without
a zombie counter the zombie figure is an upper bound, split as far as observable by
`zombie_account` with kvgate's own count of what it relayed to clients that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from kvgate.bench.gateway_queue import WaitHistogram, queue_summary, wait_histogram, waiting_now
from kvgate.bench.metrics import (
    ERROR,
    OK,
    SHED,
    TIMEOUT,
    UNAVAILABLE,
    Attempt,
    EngineTotals,
    RunResult,
    Slo,
    UserRequest,
)
from kvgate.bench.workload import Arrival
from kvgate.sim.runs import ClientModel

# Gauges and counters read from each engine's metrics page (summed over label sets).
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:request_generation_tokens_sum",
    "vllm:request_success_total",
    "sim:zombie_tokens_total",
    "sim:recomputed_tokens_total",
)
# The gateway's own view, polled beside the engines' (see `_gateway_view`).
GATEWAY_SERIES = ("queued", "gw_blocked", "gw_thrashing", "gw_reserved", "gw_peak", "gw_iter_s")


@dataclass
class LiveTarget:
    """Where clients send requests (a gateway, or the engines themselves for `direct`)."""

    urls: list[str]  # clients spread over these round-robin (one URL: a gateway)
    engines: list[str]  # engine base URLs, for their metrics pages
    model: str
    zombie_from_counter: bool = True  # False: estimate zombies as generated - delivered
    gateway: str | None = None  # polled at /admin/state and /metrics for its queue


@dataclass
class _Shared:
    """State the tasks of one run share: the clock origin and what clients got."""

    t0: float
    delivered: int = 0  # output tokens clients read, whole answers and cut-off ones
    delivered_whole: int = 0  # `usage.completion_tokens` of the answers read to the end
    departures: int = 0  # attempts the client left (timeout) or lost (error) before the end
    departed_midstream: int = 0  # ... of which after reading at least one token
    departed_events: int = 0  # SSE events with tokens those clients read before leaving
    departed_tokens: int = 0  # tokens in those events (`token_ids`)
    log: list[dict[str, object]] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    rr: int = 0
    retry_rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def now(self) -> float:
        return time.monotonic() - self.t0


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum each wanted metric over its label sets; cheap line scan, no full parse."""
    wanted = set(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.rfind(" ")
        name = line[:brace] if brace != -1 else line[:space]
        if name in wanted:
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line[space + 1 :])
    return out


def _prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic token-id prompt of length n (ids clear of special tokens)."""
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.integers(100, 8000, n)]


async def _one_attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    start: float,
    deadline_s: float,
    shared: _Shared,
    req_id: str,
) -> Attempt:
    """Send once; stream the answer until done, refusal, error or the client's deadline."""
    first: float | None = None
    read = _Read()
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(
                url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": req_id},
            ) as resp:
                if resp.status in (429, 503):
                    await resp.read()
                    return _refused(shared, req_id, start, resp)
                if resp.status >= 300:
                    await resp.read()
                    return Attempt(start, shared.now(), ERROR)
                async for raw in resp.content:
                    if read.feed(raw) and first is None:
                        first = shared.now()
                    if read.done:
                        break
                outcome = OK if read.done and read.usage is not None else ERROR
                tokens = read.usage if read.usage is not None else read.tokens
                return _end(shared, req_id, start, outcome, first, tokens, read)
    except TimeoutError:
        # Leaving the `async with` closed the connection: the server sees a disconnect.
        return _end(shared, req_id, start, TIMEOUT, first, read.tokens, read)
    except (aiohttp.ClientError, OSError, ValueError):
        return _end(shared, req_id, start, ERROR, first, read.tokens, read)


def _refused(shared: _Shared, req_id: str, start: float, resp: aiohttp.ClientResponse) -> Attempt:
    """A 429/503: note why (`X-Kvgate-Reason`) and when to come back."""
    ra = _retry_after(resp.headers)
    outcome = SHED if resp.status == 429 else UNAVAILABLE
    reason = resp.headers.get("x-kvgate-reason")
    shared.refusals[reason or str(resp.status)] += 1
    entry = {"id": req_id, "outcome": outcome, "start": round(start, 3), "reason": reason}
    shared.log.append({**entry, "retry_after": ra})
    return Attempt(start, shared.now(), outcome, retry_after_s=ra)


@dataclass
class _Read:
    """What a client read of one streamed answer: events, tokens in them, usage, the end."""

    chunks: int = 0
    tokens: int = 0
    usage: int | None = None
    done: bool = False
    error: bool = False

    def feed(self, raw: bytes) -> bool:
        """Take one line of the stream; True when it carried output tokens."""
        line = raw.strip()
        if line.startswith(b"event:") and b"error" in line:
            self.error = True
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return False
        chunk = orjson.loads(data)
        if chunk.get("usage"):
            self.usage = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices")
        if not choices:
            return False
        self.chunks += 1
        # An event may carry several tokens when the engine's server lags behind its
        # engine (vLLM merges queued outputs): `token_ids` says how many, when asked for.
        ids = choices[0].get("token_ids")
        self.tokens += len(ids) if isinstance(ids, list) else 1
        return True


def _end(
    shared: _Shared,
    req_id: str,
    start: float,
    outcome: str,
    first: float | None,
    tokens: int,
    read: _Read,
) -> Attempt:
    """Count what the client got and note every attempt that got less than a whole answer."""
    end = shared.now()
    shared.delivered += tokens
    if outcome == OK:
        shared.delivered_whole += tokens
    else:
        shared.departures += 1
        shared.departed_midstream += read.tokens > 0
        shared.departed_events += read.chunks
        shared.departed_tokens += read.tokens
        shared.log.append(
            {
                "id": req_id,
                "outcome": outcome,
                "start": round(start, 3),
                "end": round(end, 3),
                "first_token": None if first is None else round(first, 3),
                "chunks": read.chunks,
                "tokens_read": read.tokens,
                "error_event": read.error,
            }
        )
    return Attempt(start, end, outcome, first, tokens)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """`retry-after-ms` if given (finer), else `Retry-After` in seconds."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        with contextlib.suppress(ValueError):
            return float(ms) / 1000.0
    sec = headers.get("Retry-After")
    if sec is not None:
        with contextlib.suppress(ValueError):
            return float(sec)
    return None


async def _user(
    session: aiohttp.ClientSession,
    arrival: Arrival,
    client: ClientModel,
    target: LiveTarget,
    shared: _Shared,
    prompt: list[int],
    stop_at: float,
) -> UserRequest:
    """One user: wait for the arrival time, then try until served, out of tries or time."""
    await asyncio.sleep(max(0.0, arrival.t - shared.now()))
    user = UserRequest(
        arrival.id,
        arrival.kind,
        shared.now(),
        arrival.prompt_tokens,
        arrival.max_tokens,
        client.timeout_s,
    )
    payload = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": arrival.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM: each event lists its tokens (exact count on leaving)
        "ignore_eos": True,
        "temperature": 0.0,
    }
    body = orjson.dumps(payload)
    for n in range(1, client.max_attempts + 1):
        url = target.urls[shared.rr % len(target.urls)]
        shared.rr += 1
        start = shared.now()
        deadline = min(client.timeout_s, max(0.1, stop_at - start))
        attempt = await _one_attempt(
            session, url, body, start, deadline, shared, f"{arrival.id}-{n}"
        )
        user.attempts.append(attempt)
        if attempt.outcome == OK or n == client.max_attempts:
            break
        if attempt.outcome in (SHED, UNAVAILABLE):
            wait = attempt.retry_after_s if client.honor_retry_after else None
            delay = wait if wait is not None else client.retry_delay(n, shared.retry_rng)
        else:
            delay = client.retry_delay(n, shared.retry_rng)
        if shared.now() + delay >= stop_at:
            break
        await asyncio.sleep(delay)
    return user


async def _poll_engines(
    session: aiohttp.ClientSession,
    target: LiveTarget,
    shared: _Shared,
    step_s: float,
    series: dict[str, list[float]],
    stop: asyncio.Event,
) -> None:
    """Record cluster-wide KV usage, running, waiting and preemptions every `step_s`."""
    last_pre: float | None = None
    while not stop.is_set():
        tick = shared.now()
        pages = await asyncio.gather(*(_scrape(session, e) for e in target.engines))
        kv = [p.get("vllm:kv_cache_usage_perc", math.nan) for p in pages]
        pre = sum(p.get("vllm:num_preemptions_total", 0.0) for p in pages)
        series["t"].append(tick)
        series["kv_usage_max"].append(float(np.nanmax(kv)) if kv else math.nan)
        series["kv_usage_mean"].append(float(np.nanmean(kv)) if kv else math.nan)
        series["running"].append(sum(p.get("vllm:num_requests_running", 0.0) for p in pages))
        series["waiting"].append(sum(p.get("vllm:num_requests_waiting", 0.0) for p in pages))
        series["preemptions"].append(0.0 if last_pre is None else pre - last_pre)
        view = await _gateway_view(session, target.gateway)
        for key in GATEWAY_SERIES:
            series.setdefault(key, []).append(view.get(key, math.nan))
        last_pre = pre
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, step_s - (shared.now() - tick)))


async def _admin_state(
    session: aiohttp.ClientSession, gateway: str, timeout_s: float
) -> dict[str, Any] | None:
    """The gateway's `/admin/state` as a dict; None when it did not answer with one."""
    try:
        async with session.get(
            gateway + "/admin/state", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            state = orjson.loads(await resp.read())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    return state if isinstance(state, dict) else None


async def _gateway_view(session: aiohttp.ClientSession, gateway: str | None) -> dict[str, float]:
    """The gateway's view: requests waiting in its queue (`queued`), and over its nodes
    whether any refuses everything (thrashing, stale or at panic), the tokens it holds on
    them, the highest planned peak (0-1) and the slowest iteration. Empty without a
    gateway; every key NaN when the gateway did not answer."""
    if gateway is None:
        return {}
    state = await _admin_state(session, gateway, 2.0)
    if state is None:
        return {}
    out = {"queued": waiting_now(state)}
    policy = state.get("policy") or {}
    nodes = [n for n in (policy.get("nodes") or {}).values() if isinstance(n, dict)]
    if nodes:
        out["gw_blocked"] = float(
            any(n.get("state") in ("thrashing", "stale", "unknown", "panic") for n in nodes)
        )
        out["gw_thrashing"] = float(any(n.get("state") == "thrashing" for n in nodes))
        out["gw_reserved"] = float(sum(n.get("reserved_tokens") or 0.0 for n in nodes))
        peaks = [float(p) for n in nodes if isinstance(p := n.get("peak_usage"), int | float)]
        out["gw_peak"] = max(peaks, default=math.nan)
        iters = [(n.get("sample") or {}).get("iteration_latency_s") for n in nodes]
        out["gw_iter_s"] = max((float(x) for x in iters if x is not None), default=math.nan)
    return out


async def _queue_marks(
    session: aiohttp.ClientSession, gateway: str | None
) -> tuple[dict[str, Any] | None, WaitHistogram]:
    """The gateway's state and its queue-wait histogram, read once (None and empty when
    there is no gateway or it did not answer)."""
    if gateway is None:
        return None, WaitHistogram()
    state = await _admin_state(session, gateway, 5.0)
    try:
        async with session.get(
            gateway + "/metrics", timeout=aiohttp.ClientTimeout(total=5.0)
        ) as resp:
            waits = wait_histogram(await resp.text())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        waits = WaitHistogram()
    return state, waits


async def _scrape(session: aiohttp.ClientSession, engine: str) -> dict[str, float]:
    try:
        async with session.get(
            engine + "/metrics", timeout=aiohttp.ClientTimeout(total=2.0)
        ) as resp:
            return parse_metrics(await resp.text(), GAUGES + COUNTERS)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return {}


async def run_live(
    arrivals: Sequence[Arrival],
    client: ClientModel,
    target: LiveTarget,
    *,
    policy: str,
    load: float,
    seed: int,
    preset: str,
    duration_s: float,
    warmup_s: float,
    slo: Slo,
    bursts: Sequence[float] = (),
    drain_s: float | None = None,
    step_s: float = 0.5,
) -> RunResult:
    """Play `arrivals` against `target` in real time and record a `RunResult`."""
    drain = client.timeout_s if drain_s is None else drain_s
    load_before = os.getloadavg()[0]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        before = await asyncio.gather(*(_scrape(session, e) for e in target.engines))
        marks_before = await _queue_marks(session, target.gateway)
        shared = _Shared(time.monotonic(), retry_rng=np.random.default_rng([seed, 7]))
        stop_at = duration_s + drain
        series: dict[str, list[float]] = {
            k: [] for k in ("t", "kv_usage_max", "kv_usage_mean", "running", "waiting")
        }
        series["preemptions"] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_engines(session, target, shared, step_s, series, stop))
        users = [
            _user(
                session,
                a,
                client,
                target,
                shared,
                _prompt_ids(a.prompt_tokens, zlib.crc32(f"{seed}:{a.id}".encode())),
                stop_at,
            )
            for a in arrivals
            if a.t < duration_s
        ]
        requests = await asyncio.gather(*users)
        stop.set()
        await poller
        await asyncio.sleep(1.0)  # let aborted requests leave the engines' counters
        after = await asyncio.gather(*(_scrape(session, e) for e in target.engines))
        marks_after = await _queue_marks(session, target.gateway)
    relay = _relay_counters(marks_after[0])
    deltas = {
        n: sum(a.get(n, 0.0) - b.get(n, 0.0) for a, b in zip(after, before, strict=True))
        for n in COUNTERS
    }
    account = None if target.zombie_from_counter else zombie_account(deltas, shared, relay)
    return RunResult(
        policy=policy,
        load=load,
        seed=seed,
        preset=preset,
        nodes=len(target.engines),
        duration_s=duration_s,
        warmup_s=warmup_s,
        slo=slo,
        requests=list(requests),
        totals=_totals(deltas, account),
        series=series,
        bursts=list(bursts),
        extra={
            "delivered_tokens": shared.delivered,
            "engine_counters": deltas,
            "refusals_by_reason": dict(shared.refusals),
            **_queue_extra(target, series, marks_before, marks_after),
            **({} if account is None else {"zombie_account": account}),
            "notes": [
                f"{policy} @ {load:g}x: machine load average {load_before:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after (2 cores shared with other work)",
                *([] if account is None else [zombie_note(policy, load, account)]),
            ],
            "_attempt_log": shared.log,  # not in results.json: every try that fell short
        },
    )


def _queue_extra(
    target: LiveTarget,
    series: dict[str, list[float]],
    before: tuple[dict[str, Any] | None, WaitHistogram],
    after: tuple[dict[str, Any] | None, WaitHistogram],
) -> dict[str, dict[str, float]]:
    """`gateway_queue` (see `kvgate.bench.gateway_queue`) for a run through a gateway, from
    its (state, wait histogram) read before and after the run."""
    if target.gateway is None:
        return {}
    waiting = [w for w in series.get("queued", ()) if not math.isnan(w)]
    peak = max(waiting, default=math.nan)
    waits = after[1].since(before[1])
    return {"gateway_queue": queue_summary(before[0], after[0], waits, peak)}


def _relay_counters(state: dict[str, Any] | None) -> dict[str, int]:
    """The gateway's count of streams whose client left (`kvgate_client_gone_*`), if any."""
    if state is None:
        return {}
    counters = state.get("gateway") or {}
    keys = ("client_gone_streams", "client_gone_events", "events_after_client_gone")
    return {k: int(counters[k]) for k in keys if isinstance(counters.get(k), int)}


def zombie_account(
    deltas: dict[str, float], shared: _Shared, relay: dict[str, int]
) -> dict[str, float]:
    """Split the tokens a real engine generated that no client read, as far as observable.

    A real engine has no zombie counter; vLLM counts a token when its API server takes it
    from the engine core, and stops counting a request when it aborts it. So

        undelivered = generated - whole answers read - tokens read by clients that left

    holds, besides zombie tokens (made after the client left, before the abort landed),
    tokens made *before* the client left that it never read: still in the engine's server,
    in the relay, or in socket buffers of a client that lagged. The relay counts the events
    it had passed on to clients that then left; those beyond what the clients read were
    made before they left, so they are not zombies. Converted to tokens at the departed
    clients' own tokens per event, they are subtracted to give `zombie_bound`, an upper
    bound of zombie tokens (the tokens made just before a client left that were still in
    the engine's server are in it too). Without a relay (`direct`) the bound is `undelivered`.
    """
    generated = deltas.get("vllm:generation_tokens_total", 0.0)
    finished = deltas.get("vllm:request_generation_tokens_sum", math.nan)
    undelivered = max(0.0, generated - shared.delivered_whole - shared.departed_tokens)
    per_event = shared.departed_tokens / shared.departed_events if shared.departed_events else 1.0
    unread_events = math.nan
    unread_tokens = 0.0
    if "client_gone_events" in relay:
        unread_events = float(max(0, relay["client_gone_events"] - shared.departed_events))
        unread_tokens = min(undelivered, unread_events * per_event)
    bound = undelivered - unread_tokens
    return {
        "generated": generated,
        "in_finished_requests": finished,
        "in_aborted_requests": generated - finished,
        "read_whole": float(shared.delivered_whole),
        "departures": float(shared.departures),
        "departed_midstream": float(shared.departed_midstream),
        "read_by_departed": float(shared.departed_tokens),
        "undelivered": undelivered,
        "relayed_unread_events": unread_events,
        "relayed_unread_tokens": unread_tokens,
        "events_after_client_gone": float(relay.get("events_after_client_gone", math.nan)),
        "zombie_bound": bound,
        "zombie_bound_per_departure": bound / shared.departures if shared.departures else 0.0,
    }


def zombie_note(policy: str, load: float, a: dict[str, float]) -> str:
    """One line of the report: where the tokens nobody read went."""
    text = (
        f"{policy} @ {load:g}x, zombie accounting: engine generated {a['generated']:,.0f} "
        f"tokens, whole answers read {a['read_whole']:,.0f}, {a['departures']:,.0f} tries "
        f"ended before their answer ({a['departed_midstream']:,.0f} mid-stream; they had read "
        f"{a['read_by_departed']:,.0f} tokens); nobody read {a['undelivered']:,.0f}"
    )
    if not math.isnan(a["relayed_unread_events"]):
        text += (
            f", of which ~{a['relayed_unread_tokens']:,.0f} in {a['relayed_unread_events']:,.0f} "
            f"events kvgate had relayed to clients still connected (made before they left); "
            f"events kvgate read after a client left: {a['events_after_client_gone']:,.0f}"
        )
    return (
        text + f"; zombie tokens at most {a['zombie_bound']:,.0f} "
        f"({a['zombie_bound_per_departure']:.1f} per try that ended early)"
    )


def _totals(deltas: dict[str, float], account: dict[str, float] | None) -> EngineTotals:
    """Engine totals; zombies from the engine's counter, or the bound of `zombie_account`."""
    zombies = (
        deltas.get("sim:zombie_tokens_total", 0.0) if account is None else account["zombie_bound"]
    )
    return EngineTotals(
        preemptions=int(deltas.get("vllm:num_preemptions_total", 0.0)),
        recomputed_tokens=int(deltas.get("sim:recomputed_tokens_total", 0.0)),
        zombie_tokens=round(zombies),
        generated_tokens=int(deltas.get("vllm:generation_tokens_total", 0.0)),
    )


# --- processes -----------------------------------------------------------------------------


def free_port(count: int = 1) -> int:
    """A port p such that p..p+count-1 were all free a moment ago, on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + count > 65535:
            continue
        if all(_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no block of free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Proc:
    """A child process we started, stopped with SIGTERM (then SIGKILL) by its own pid."""

    popen: subprocess.Popen[bytes]
    name: str

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def start(cmd: Sequence[str], name: str, log: Path, env: dict[str, str] | None = None) -> Proc:
    """Start `cmd` with its output in `log` (a benchmark must not drown the terminal)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        popen = subprocess.Popen(
            list(cmd),
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return Proc(popen, name)


async def wait_healthy(url: str, proc: Proc, timeout_s: float) -> None:
    """Poll `url` until it answers 200; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{proc.name} not healthy at {url} after {timeout_s:.0f} s")


def kvgate_cmd(*args: str) -> list[str]:
    """`kvgate ...` run with this interpreter, so the venv in use is the one benchmarked."""
    return [sys.executable, "-m", "kvgate", *args]
