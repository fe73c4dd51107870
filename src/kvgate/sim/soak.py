"""The chaos soak: a real kvgate process, misbehaving engines, misbehaving clients.

`run_soak()` starts simulated engines behind `kvgate.sim.chaos` fronts in this process,
starts `kvgate serve` as a child process in front of them (API keys, tenant limits, the
adaptive policy, tight timeouts), lets a `ChaosMonkey` crash, restart, stall and reset the
engines and hang or garble their metrics, while client workers send as many requests as
fit in the time: complete and streamed ones, ones cancelled before the response headers,
mid-stream or while waiting for a non-streamed answer, and malformed ones.

Every answer is checked (a correct completion, a correct stream ending in `[DONE]` or in an
SSE `error` event, or an OpenAI-shaped error with an allowed status and, for 429/503, a
Retry-After). After the traffic the engines are healed and the books are read from
`/admin/state` and `/metrics`: requests in flight, tickets, reserved tokens, requests in the
gateway's queue, tenant usage, and the engines' own running/waiting queues must all be
exactly zero; the gateway's RSS must not have grown by more than the stated bound since
the end of the warm-up; its log must hold no traceback; and it must still serve.

Used by `tests/reliability/test_soak.py` (about a minute, in CI) and by
`benchmarks/soak/run_soak.py` (longer, writes `results.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from kvgate.gateway.http.guard import CLIENT_TIMEOUT_S
from kvgate.sim.chaos import ChaosMonkey, ChaosNode
from kvgate.sim.presets import get_preset

MODEL = "sim-llama"
ADMIN = "soak-admin-token-0123456789"
KEYS = {
    "alpha": ("soak-alpha-key-0123456789", "critical"),
    "beta": ("soak-beta-key-01234567890", "standard"),
    "gamma": ("soak-gamma-key-0123456789", "sheddable"),
}
#: Statuses a well-formed request may get under chaos (each with an OpenAI error body).
#: No 500: neither kvgate's own nor a relayed engine 500 ("the request was aborted by the
#: engine") may reach a client that is still waiting. The engine aborts a request only when
#: its connection closed or kvgate asked it to, both after kvgate gave up on it. (Such 500s
#: were once seen here: the simulator handed a dropped request's abort to the same-id
#: retry kvgate had sent on a fresh connection; `tests/sim/test_server_ids.py`.)
ALLOWED_ERRORS = frozenset({429, 502, 503, 504})
_LISTEN_RE = re.compile(r"kvgate listening on http://127\.0\.0\.1:(\d+)")

#: Kinds of client behaviour and their weights.
ACTIONS = {
    "complete": 26,
    "stream": 26,
    "cancel_before_headers": 10,
    "cancel_waiting": 10,
    "cancel_mid_stream": 12,
    "malformed": 15,
    "slow_client": 1,
}
#: How long a slow client waits for its 408: the gateway's read deadline plus a margin.
SLOW_CLIENT_WAIT_S = CLIENT_TIMEOUT_S + 10.0


@dataclass
class SoakSettings:
    duration_s: float = 60.0
    warmup_s: float = 4.0
    nodes: int = 3
    workers: int = 24
    seed: int = 1
    fault_interval_s: float = 0.25
    rss_growth_bound_mib: float = 48.0
    gateway_log: str | None = None  # where to keep the gateway's log (default: temp dir)


@dataclass
class SoakReport:
    settings: SoakSettings
    requests: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    leaks: dict[str, Any] = field(default_factory=dict)
    rss_start_kib: int = 0
    rss_warm_kib: int = 0
    rss_end_kib: int = 0
    rss_peak_kib: int = 0
    elapsed_s: float = 0.0
    scrape_warnings: int = 0
    scrape_failures: int = 0
    log_errors: int = 0
    still_serves: bool = False

    @property
    def cancellations(self) -> int:
        return sum(v for k, v in self.actions.items() if k.startswith("cancel"))

    @property
    def faults_injected(self) -> int:
        """Crashes, metrics episodes, random resets and stalls (not their consequences:
        restarts and the connections a crash reset)."""
        skip = ("restart", "connections_reset_by_crash")
        return sum(v for k, v in self.faults.items() if k not in skip)

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_end_kib - self.rss_warm_kib) / 1024

    @property
    def leaks_found(self) -> int:
        return sum(1 for v in self.leaks.values() if v)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and self.leaks_found == 0
            and self.still_serves
            and self.log_errors == 0
            and self.rss_growth_mib <= self.settings.rss_growth_bound_mib
        )

    def violation(self, text: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(text)


# ---- the gateway process -------------------------------------------------------------------


def _gateway_config(nodes: list[ChaosNode]) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "log_level": "info",
                   "admin_token": ADMIN, "drain_timeout_s": 2.0},
        "backends": [{"url": n.url, "metrics_url": n.metrics_url, "name": f"node{i}"}
                     for i, n in enumerate(nodes)],
        "scrape": {"interval_s": 0.2},
        "admission": {"policy": "adaptive", "stale_after_s": 1.0},
        "upstream": {"read_timeout_s": 1.0},  # 10 s for the headers
        "limits": {"max_body_bytes": 64 * 1024},
        "auth": {
            "keys": [{"key": key, "tenant": tenant, "max_priority": prio,
                      "default_priority": "sheddable" if prio == "sheddable" else "standard"}
                     for tenant, (key, prio) in KEYS.items()],
            "tenants": {"gamma": {"max_in_flight_tokens": 3000, "max_in_flight_requests": 6}},
        },
    }  # fmt: skip


class GatewayProcess:
    """`python -m kvgate serve` with a config file; its port is read from its log."""

    def __init__(self, config: dict[str, Any], workdir: Path, log_path: Path) -> None:
        self.config_path = workdir / "kvgate.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    async def start(self, within_s: float = 60.0) -> None:
        log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in list(env):
            if name.startswith("KVGATE_"):
                del env[name]  # the soak's config, not the caller's environment
        self.process = subprocess.Popen(  # noqa: ASYNC220 (returns at once; no wait)
            [sys.executable, "-m", "kvgate", "serve", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvgate exited at start:\n{self.log_path.read_text()[-3000:]}")
            match = _LISTEN_RE.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}"
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("kvgate did not start in time")

    def rss_kib(self) -> int:
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    async def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        for _ in range(150):
            if self.process.poll() is not None:
                return self.process.returncode
            await asyncio.sleep(0.1)
        self.process.kill()
        self.process.wait()
        return self.process.returncode


# ---- clients ---------------------------------------------------------------------------------


def _headers(rng: random.Random) -> dict[str, str]:
    tenant = rng.choice(list(KEYS))
    headers = {"Authorization": f"Bearer {KEYS[tenant][0]}"}
    if rng.random() < 0.3:
        headers["X-Kvgate-Priority"] = rng.choice(["critical", "standard", "sheddable"])
    return headers


def _body(rng: random.Random, *, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "stream": stream,
                            "max_tokens": max_tokens or rng.randint(1, 24)}  # fmt: skip
    if rng.random() < 0.5:
        body["prompt"] = "soak " * rng.randint(1, 200)
    else:
        body = {**body, "messages": [{"role": "user", "content": "hi " * rng.randint(1, 100)}]}
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    return body


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _malformed(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], int]:
    """(method, path, body, headers, expected status) of one bad request."""
    good = _headers(rng)
    cases: list[tuple[str, str, bytes, dict[str, str], int]] = [
        ("POST", "/v1/completions", b"{not json", good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": -3}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": "9"}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": 1e9}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": 2147483648}', good, 400),
        ("POST", "/v1/chat/completions", b'{"messages": []}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "prompt": "\xff\xfe"}', good, 400),
        ("POST", "/v1/completions", b'{"model": "nope", "prompt": "x"}', good, 404),
        ("POST", "/v1/completions", b"[" + b" " * (70 * 1024) + b"]", good, 413),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}', {}, 401),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}',
         {"Authorization": "Bearer soak-wrong-key-0123456789"}, 401),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}',
         {**good, "X-Kvgate-Priority": "urgent"}, 400),
        ("GET", "/v1/completions", b"", good, 405),
        ("GET", "/admin/state", b"", good, 401),
    ]  # fmt: skip
    return rng.choice(cases)


class Clients:
    """Worker coroutines that each loop over random actions until the deadline."""

    def __init__(self, url: str, report: SoakReport, seed: int) -> None:
        self.url = url
        self.report = report
        self.seed = seed
        self.session: aiohttp.ClientSession | None = None
        self.until = 0.0
        self._slow: set[asyncio.Task[None]] = set()

    async def run(self, workers: int, until: float) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=30)
        self.until = until
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.session = session
            await asyncio.gather(*(self._worker(i, until) for i in range(workers)))
            await asyncio.gather(*self._slow)  # each answered or timed out by now

    async def _worker(self, index: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = list(ACTIONS), list(ACTIONS.values())
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            kind = rng.choices(kinds, weights)[0]
            if kind == "slow_client" and loop.time() + SLOW_CLIENT_WAIT_S > until:
                continue  # its 408 could not come before the end of the run
            self.report.actions[kind] += 1
            self.report.requests += 1
            try:
                await getattr(self, f"_{kind}")(rng)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self.report.violation(f"{kind}: client error {type(exc).__name__}: {exc}")

    def _status(self, status: int, resp: aiohttp.ClientResponse | None = None) -> None:
        reason = resp.headers.get("X-Kvgate-Reason") if resp is not None else None
        self.report.statuses[f"{status}:{reason}" if reason else str(status)] += 1

    async def _check_error(self, kind: str, resp: aiohttp.ClientResponse, body: bytes) -> None:
        status = resp.status
        try:
            error = orjson.loads(body)["error"]
            shaped = set(error) == {"message", "type", "param", "code"} and error["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            shaped = False
        if not shaped:
            self.report.violation(f"{kind}: {status} without an OpenAI error body: {body[:200]!r}")
        if status in (429, 503) and "Retry-After" not in resp.headers:
            self.report.violation(f"{kind}: {status} without Retry-After")

    async def _complete(self, rng: random.Random) -> None:
        await self._honest("complete", rng, stream=False)

    async def _stream(self, rng: random.Random) -> None:
        await self._honest("stream", rng, stream=True)

    async def _honest(self, kind: str, rng: random.Random, *, stream: bool) -> None:
        """A well-formed request read to the end: a correct answer or a well-formed error."""
        assert self.session is not None
        body = _body(rng, stream=stream)
        async with self.session.post(
            self.url + _path(body), json=body, headers=_headers(rng)
        ) as resp:
            data = await resp.read()
            self._status(resp.status, resp)
            if resp.status == 200 and stream:
                self._check_stream(data)
            elif resp.status == 200:
                self._check_whole(data)
            elif resp.status in ALLOWED_ERRORS:
                await self._check_error(kind, resp, data)
            else:
                rid = resp.headers.get("X-Request-Id")
                self.report.violation(
                    f"{kind}: unexpected status {resp.status} (id {rid}): {data[:200]!r}"
                )

    def _check_whole(self, data: bytes) -> None:
        parsed = orjson.loads(data)
        if not parsed.get("choices") or "usage" not in parsed:
            self.report.violation(f"complete: 200 without choices/usage: {data[:200]!r}")

    def _check_stream(self, data: bytes) -> None:
        events = [e for e in data.split(b"\n\n") if e.strip()]
        if not events:
            self.report.violation("stream: 200 with an empty body")
            return
        last = events[-1]
        if last.startswith(b"event: error\ndata: "):
            self.report.statuses["200+sse_error"] += 1
            try:
                orjson.loads(last.split(b"data: ", 1)[1])["error"]["code"]
            except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
                self.report.violation(f"stream: malformed error event {last[:200]!r}")
            events = events[:-1]
        elif last != b"data: [DONE]":
            self.report.violation(f"stream: ends without [DONE] or error: {last[-200:]!r}")
            return
        else:
            events = events[:-1]
        for event in events:
            if not event.startswith(b"data: {"):
                self.report.violation(f"stream: odd event {event[:200]!r}")
                return
            try:
                orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                self.report.violation(f"stream: event is not JSON {event[:200]!r}")
                return

    async def _cancel_before_headers(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=rng.random() < 0.5, max_tokens=rng.randint(50, 300))
        task = asyncio.ensure_future(
            self.session.post(self.url + _path(body), json=body, headers=_headers(rng))
        )
        await asyncio.sleep(rng.uniform(0.0, 0.02))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            resp = await task
            resp.close()  # answered before we gave up (a quick 429, say): drop it anyway

    async def _cancel_waiting(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=False, max_tokens=rng.randint(100, 400))
        body["ignore_eos"] = True

        async def call() -> None:
            assert self.session is not None
            async with self.session.post(
                self.url + _path(body), json=body, headers=_headers(rng)
            ) as resp:
                await resp.read()

        task = asyncio.ensure_future(call())
        await asyncio.sleep(rng.uniform(0.02, 0.4))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _cancel_mid_stream(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=True, max_tokens=rng.randint(50, 400))
        body["ignore_eos"] = True
        async with self.session.post(
            self.url + _path(body), json=body, headers=_headers(rng)
        ) as resp:
            self._status(resp.status, resp)
            if resp.status != 200:
                await self._check_error("cancel_mid_stream", resp, await resp.read())
                return
            wanted = rng.randint(1, 6)
            seen = 0
            async for _ in resp.content.iter_any():
                seen += 1
                if seen >= wanted:
                    break
            resp.close()  # drop the connection mid-stream

    async def _malformed(self, rng: random.Random) -> None:
        assert self.session is not None
        method, path, data, headers, expected = _malformed(rng)
        headers = {**headers, "Content-Type": "application/json"}
        async with self.session.request(method, self.url + path, data=data, headers=headers) as r:
            body = await r.read()
            self._status(r.status)
            if r.status != expected:
                self.report.violation(f"malformed {path} {data[:60]!r}: {r.status} != {expected}")
            await self._check_error("malformed", r, body)

    async def _slow_client(self, rng: random.Random) -> None:
        """Half a request line, then silence: the 408 comes after the gateway's read
        deadline, so the client waits for it in a task of its own and the worker goes on."""
        task = asyncio.create_task(self._stalled_request())
        self._slow.add(task)
        task.add_done_callback(self._slow.discard)

    async def _stalled_request(self) -> None:
        host, _, port = self.url.removeprefix("http://").rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            self.report.violation(f"slow_client: client error {type(exc).__name__}: {exc}")
            return
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
            await writer.drain()
            async with asyncio.timeout(SLOW_CLIENT_WAIT_S):
                answer = await reader.read()
        except (TimeoutError, OSError) as exc:
            self.report.violation(f"slow_client: client error {type(exc).__name__}: {exc}")
            return
        finally:
            writer.close()
        self._status(408 if answer.startswith(b"HTTP/1.1 408") else 0)
        if not answer.startswith(b"HTTP/1.1 408"):
            self.report.violation(f"slow_client: expected 408, got {answer[:80]!r}")


# ---- the run -----------------------------------------------------------------------------------


async def _admin_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/admin/state", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        state: dict[str, Any] = orjson.loads(await r.read())
        return state


def _books(state: dict[str, Any], metrics: str, nodes: list[ChaosNode]) -> dict[str, Any]:
    """Everything that must be zero once no request is in progress."""
    policy = state["policy"]
    tenants = policy.get("tenants", {})
    gauges = {
        name: float(value)
        for name, value in re.findall(
            r"^(kvgate_requests_in_flight|kvgate_tenant_in_flight_\w+\{[^}]*\}) (\S+)$",
            metrics,
            re.M,
        )
    }
    return {
        "gateway_in_flight": state["gateway"]["in_flight"],
        "policy_tickets": policy["in_flight_requests"],
        "policy_in_flight_tokens": policy["controller"].get("in_flight_tokens") or 0,
        "queue_waiting": policy["queue"]["waiting"],
        "reserved_tokens": {n: s["reserved_tokens"] for n, s in policy["nodes"].items()
                            if s["reserved_tokens"]},
        "tenant_usage": {t: (u["in_flight_tokens"], u["in_flight_requests"])
                         for t, u in tenants.items()
                         if u["in_flight_tokens"] or u["in_flight_requests"]},
        "metrics_nonzero": {k: v for k, v in gauges.items() if v},
        "engine_queues": {i: (n.sim.engine.num_running, n.sim.engine.num_waiting)
                          for i, n in enumerate(nodes)
                          if n.sim.engine.num_running or n.sim.engine.num_waiting},
        # The simulator's own books: an id whose end the engine never reported stays taken.
        "engine_open_requests": {i: n.sim.open_requests for i, n in enumerate(nodes)
                                 if n.sim.open_requests},
    }  # fmt: skip


async def _settle(
    session: aiohttp.ClientSession, url: str, nodes: list[ChaosNode], within_s: float
) -> dict[str, Any]:
    """Poll the books until all are zero (or time runs out); returns the last reading."""
    deadline = time.monotonic() + within_s
    while True:
        state = await _admin_json(session, url)
        async with session.get(url + "/metrics") as r:
            metrics = (await r.read()).decode()
        books = _books(state, metrics, nodes)
        if not any(books.values()) or time.monotonic() > deadline:
            return books
        await asyncio.sleep(0.2)


async def _still_serves(session: aiohttp.ClientSession, url: str) -> bool:
    headers = {"Authorization": f"Bearer {KEYS['alpha'][0]}"}
    body = {"model": MODEL, "prompt": "still there?", "max_tokens": 4}
    for _ in range(50):
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status == 200 and (await r.json()).get("choices"):
                return True
        await asyncio.sleep(0.2)
    return False


def _scan_log(text: str, report: SoakReport) -> None:
    report.scrape_warnings = text.count("metrics scrape failed")
    report.log_errors = sum(
        text.count(marker)
        for marker in ("Traceback", "Exception in ASGI application", " ERROR ", "CRITICAL")
    )


async def run_soak(settings: SoakSettings) -> SoakReport:
    """Run one soak; never raises for a finding (see `report.ok` and `report.violations`)."""
    report = SoakReport(settings)
    # The simulated engines log every client that vanished mid-answer (aiohttp's
    # "Error handling request"); under chaos that is the point, not news.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    nodes = [
        await ChaosNode(get_preset("cpu-tiny"), seed=settings.seed + i).start()
        for i in range(settings.nodes)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    log_path = Path(settings.gateway_log) if settings.gateway_log else workdir / "gateway.log"
    gateway = GatewayProcess(_gateway_config(nodes), workdir, log_path)
    started = time.monotonic()
    try:
        await gateway.start()
        report.rss_start_kib = gateway.rss_kib()
        async with aiohttp.ClientSession() as admin:
            if not await _still_serves(admin, gateway.url):
                report.violation("the gateway never served its first request")
                return report
            await _traffic(settings, report, gateway, nodes)
            books = await _settle(admin, gateway.url, nodes, 10.0)
            report.leaks = {k: v for k, v in books.items()}
            state = await _admin_json(admin, gateway.url)
            report.scrape_failures = sum(
                n["failures_total"] for n in state["scraper"]["nodes"].values()
            )
            report.still_serves = await _still_serves(admin, gateway.url)
            report.rss_end_kib = gateway.rss_kib()
            report.rss_peak_kib = max(report.rss_peak_kib, report.rss_end_kib)
    finally:
        code = await gateway.stop()
        if code not in (0, None):
            report.violation(f"kvgate exited with code {code} on SIGTERM")
        for node in nodes:
            await node.close()
        report.elapsed_s = time.monotonic() - started
        with contextlib.suppress(OSError):
            _scan_log(log_path.read_text(errors="replace"), report)
        if report.ok:  # keep the config and log of a failed run for the post-mortem
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            report.violation(f"config and log kept in {workdir}")
    return report


async def _traffic(
    settings: SoakSettings, report: SoakReport, gateway: GatewayProcess, nodes: list[ChaosNode]
) -> None:
    """Warm-up without faults (RSS baseline), then chaos and clients for `duration_s`."""
    loop = asyncio.get_running_loop()
    warm = Clients(gateway.url, SoakReport(settings), settings.seed + 99)
    await warm.run(settings.workers, loop.time() + settings.warmup_s)
    report.rss_warm_kib = gateway.rss_kib()
    monkey = ChaosMonkey(nodes, seed=settings.seed, mean_interval_s=settings.fault_interval_s)
    clients = Clients(gateway.url, report, settings.seed)

    async def sample_rss() -> None:
        while True:
            report.rss_peak_kib = max(report.rss_peak_kib, gateway.rss_kib())
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample_rss())
    try:
        until = loop.time() + settings.duration_s
        chaos = asyncio.create_task(monkey.run(settings.duration_s))
        await clients.run(settings.workers, until)
        report.faults.update(await chaos)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler


def summary(report: SoakReport) -> str:
    """A short human-readable account of one soak."""
    s = report.settings
    lines = [
        f"soak: {report.requests} requests in {s.duration_s:.0f} s ({s.workers} workers, "
        f"{s.nodes} engines), {report.cancellations} cancellations, "
        f"{report.actions['malformed']} malformed, {report.faults_injected} faults injected",
        f"statuses: {dict(sorted(report.statuses.items()))}",
        f"faults: {dict(sorted(report.faults.items()))}",
        f"leaks found: {report.leaks_found} {report.leaks if report.leaks_found else ''}",
        f"RSS: start {report.rss_start_kib / 1024:.1f} MiB, after warm-up "
        f"{report.rss_warm_kib / 1024:.1f} MiB, end {report.rss_end_kib / 1024:.1f} MiB "
        f"(growth {report.rss_growth_mib:+.1f} MiB, bound {s.rss_growth_bound_mib:.0f} MiB), "
        f"peak {report.rss_peak_kib / 1024:.1f} MiB",
        f"scrape failures {report.scrape_failures}, logged {report.scrape_warnings} times; "
        f"log errors {report.log_errors}; still serves: {report.still_serves}",
        f"violations: {len(report.violations)}",
        *[f"  - {v}" for v in report.violations[:20]],
    ]
    return "\n".join(lines)
