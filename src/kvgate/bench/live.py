"""A real HTTP load generator with real client behaviour, and the processes it talks to.

Each user request is an asyncio task that sends streaming `/v1/completions` with a token-id
prompt (exact length on every engine) and `ignore_eos`, so the work asked for is the same
whatever the engine. The client behaves as in the virtual runs (`ClientModel`): when its
deadline passes it closes the connection (a real disconnect the engine or gateway sees);
a timeout or 5xx is retried; a 429 waits out `Retry-After`; after N tries it gives up.
While the run goes, every engine's `/metrics` is polled to record the time series.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson

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
from kvgate.sim.virtual import ClientModel

# Gauges and counters read from each engine's metrics page (summed over label sets).
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "sim:zombie_tokens_total",
    "sim:recomputed_tokens_total",
)


@dataclass
class LiveTarget:
    """Where clients send requests (a gateway, or the engines themselves for `direct`)."""

    urls: list[str]  # clients spread over these round-robin (one URL: a gateway)
    engines: list[str]  # engine base URLs, for their metrics pages
    model: str
    zombie_from_counter: bool = True  # False: estimate zombies as generated - delivered
    gateway: str | None = None  # polled at /admin/state for the shed probability


@dataclass
class _Shared:
    """State the tasks of one run share: the clock origin and the delivered-token count."""

    t0: float
    delivered: int = 0
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
    return rng.integers(100, 8000, n).tolist()


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
    tokens = 0
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(
                url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Request-Id": req_id},
            ) as resp:
                if resp.status in (429, 503):
                    ra = _retry_after(resp.headers)
                    outcome = SHED if resp.status == 429 else UNAVAILABLE
                    await resp.read()
                    return Attempt(start, shared.now(), outcome, retry_after_s=ra)
                if resp.status >= 300:
                    await resp.read()
                    return Attempt(start, shared.now(), ERROR)
                usage = None
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = orjson.loads(data)
                    if chunk.get("choices"):
                        if first is None:
                            first = shared.now()
                        tokens += 1
                    if chunk.get("usage"):
                        usage = chunk["usage"].get("completion_tokens")
                if usage is not None:
                    tokens = int(usage)
                shared.delivered += tokens
                return Attempt(start, shared.now(), OK, first, tokens)
    except TimeoutError:
        # Leaving the `async with` closed the connection: the server sees a disconnect.
        shared.delivered += tokens
        return Attempt(start, shared.now(), TIMEOUT, first, tokens)
    except (aiohttp.ClientError, OSError, ValueError):
        shared.delivered += tokens
        return Attempt(start, shared.now(), ERROR, first, tokens)


def _retry_after(headers: aiohttp.typedefs.LooseHeaders) -> float | None:  # type: ignore[name-defined]
    """`retry-after-ms` if given (finer), else `Retry-After` in seconds."""
    ms = headers.get("retry-after-ms")  # type: ignore[union-attr]
    if ms is not None:
        with contextlib.suppress(ValueError):
            return float(ms) / 1000.0
    sec = headers.get("Retry-After")  # type: ignore[union-attr]
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
        series["shed_prob"].append(await _shed_prob(session, target.gateway))
        last_pre = pre
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, step_s - (shared.now() - tick)))


async def _shed_prob(session: aiohttp.ClientSession, gateway: str | None) -> float:
    """The gateway's shed probability for standard traffic (0 without a gateway)."""
    if gateway is None:
        return 0.0
    try:
        async with session.get(
            gateway + "/admin/state", timeout=aiohttp.ClientTimeout(total=2.0)
        ) as resp:
            state = orjson.loads(await resp.read())
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return math.nan
    ctrl = (state.get("policy") or {}).get("controller") or {}
    prob = ctrl.get("shed_probability")
    return float(prob.get("standard") or 0.0) if isinstance(prob, dict) else 0.0


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
        shared = _Shared(time.monotonic(), retry_rng=np.random.default_rng([seed, 7]))
        stop_at = duration_s + drain
        series: dict[str, list[float]] = {
            k: [] for k in ("t", "kv_usage_max", "kv_usage_mean", "running", "waiting")
        }
        series["preemptions"] = []
        series["shed_prob"] = []
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
    totals = _totals(before, after, shared.delivered, target.zombie_from_counter)
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
        totals=totals,
        series=series,
        bursts=list(bursts),
        extra={
            "delivered_tokens": shared.delivered,
            "notes": [
                f"{policy} @ {load:g}x: machine load average {load_before:.1f} before, "
                f"{os.getloadavg()[0]:.1f} after (2 cores shared with other work)"
            ],
        },
    )


def _totals(
    before: Sequence[dict[str, float]],
    after: Sequence[dict[str, float]],
    delivered: int,
    zombie_from_counter: bool,
) -> EngineTotals:
    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    generated = int(delta("vllm:generation_tokens_total"))
    zombies = (
        int(delta("sim:zombie_tokens_total"))
        if zombie_from_counter
        else max(0, generated - delivered)
    )
    return EngineTotals(
        preemptions=int(delta("vllm:num_preemptions_total")),
        recomputed_tokens=int(delta("sim:recomputed_tokens_total")),
        zombie_tokens=zombies,
        generated_tokens=generated,
    )


# --- processes -----------------------------------------------------------------------------


def free_port(count: int = 1) -> int:
    """A port p such that p..p+count-1 were all free a moment ago, on 127.0.0.1."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
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
