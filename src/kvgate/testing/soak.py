"""The chaos soak: a real kvgate process, misbehaving engines, misbehaving clients.

`run_soak()` starts simulated engines behind `kvgate.testing.chaos` fronts in this process,
starts `kvgate serve` as a child process in front of them (API keys, tenant limits, the
adaptive policy, tight timeouts), lets a `ChaosMonkey` crash, restart, stall and reset the
engines and hang or garble their metrics, while client workers send as many requests as
fit in the time: complete and streamed ones, ones cancelled before the response headers,
mid-stream or while waiting for a non-streamed answer, and malformed ones.

Every answer is checked by the clients (`kvgate.testing.soak_clients`). After the traffic
the engines are healed and the books are read from `/admin/state` and `/metrics`: requests
in flight, tickets, reserved tokens, requests in the gateway's queue, tenant usage, and the
engines' own running/waiting queues must all be exactly zero; the gateway's RSS must not
have grown by more than the stated bound since the end of the warm-up; its log must hold
no traceback; and it must still serve (`kvgate.testing.soak_report`).

Used by `tests/reliability/test_soak.py` (about a minute, in CI) and by
`benchmarks/soak/run_soak.py` (longer, writes `results.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from kvgate.sim.presets import get_preset
from kvgate.testing.chaos import ChaosMonkey, ChaosNode
from kvgate.testing.soak_clients import KEYS, MODEL, Clients
from kvgate.testing.soak_report import SoakReport, SoakSettings

ADMIN = "soak-admin-token-0123456789"
_LISTEN_RE = re.compile(r"kvgate listening on http://127\.0\.0\.1:(\d+)")


# ---- the gateway process -------------------------------------------------------------------


def _gateway_config(nodes: list[ChaosNode]) -> dict[str, Any]:
    return {
        "server": {"listen": "127.0.0.1:0", "log_level": "info",
                   "admin_token": ADMIN, "drain_timeout_s": 2.0},
        "backends": [{"url": n.url, "metrics_url": n.metrics_url, "name": f"node{i}"}
                     for i, n in enumerate(nodes)],
        "scrape": {"interval_s": 0.2},
        "admission": {"stale_after_s": 1.0},
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
