"""Start and stop what a live run talks to: `kvgate sim` engines, `kvgate serve`, real vLLM.

Each live-sim run gets fresh engines and a fresh gateway, so no run inherits another's
queues or counters. The real vLLM engine takes 30-60 s to start, so it is started once
for all the runs of a report, under the machine-wide lock, and the runner waits until it
is idle between runs. Every process started here is stopped here, by its own pid.
`KVGATE_BENCH_ACCESS_LOG=true` turns on the gateways' access log (in `LOGS`), for diagnosis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from kvgate.bench.live.client import LiveTarget
from kvgate.bench.live.poll import parse_metrics
from kvgate.bench.live.run import LiveOptions, run_live
from kvgate.bench.metrics import RunResult
from kvgate.bench.suite import RunSpec
from kvgate.bench.workload import burst_times, generate
from kvgate.procs import children
from kvgate.procs.ports import free_port

LOGS = Path("/tmp/kvgate-bench-logs")


@dataclass
class Proc:
    """A child process we started, stopped with SIGTERM (then SIGKILL) by its own pid."""

    popen: subprocess.Popen[bytes]
    name: str

    def stop(self, grace_s: float = 10.0) -> None:
        children.stop(self.popen, grace_s)


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


def _gateway_cmd(spec: RunSpec) -> list[str]:
    """`kvgate serve` for kvgate's policy; the benchmark's own gateway for a baseline, its
    quotas (`policy_overrides["baseline"]`) as flags."""
    if spec.policy == "adaptive":
        return kvgate_cmd("serve")
    cmd = [sys.executable, "-m", "kvgate.bench.serve", "--baseline", spec.policy]
    for key, value in (spec.policy_overrides.get("baseline") or {}).items():
        cmd += [f"--{key}", str(value)]
    return cmd


def _gateway_env(spec: RunSpec, engines: list[str], port: int, scrape_s: float) -> dict[str, str]:
    env = {
        "KVGATE_SCRAPE__INTERVAL_S": str(scrape_s),
        "KVGATE_BACKENDS": json.dumps([{"url": u} for u in engines]),
        "KVGATE_SERVER__LISTEN": f"127.0.0.1:{port}",
        # Access lines are written at info: on only when asked.
        "KVGATE_SERVER__LOG_LEVEL": (
            "info" if os.environ.get("KVGATE_BENCH_ACCESS_LOG") == "true" else "warning"
        ),
    }
    for key, value in spec.policy_overrides.items():
        if key != "baseline":  # the baselines' quotas are flags (`_gateway_cmd`)
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            env[f"KVGATE_ADMISSION__{key.upper()}"] = text
    if not spec.queue:
        env["KVGATE_QUEUE__MAX_WAIT_S"] = (
            '{"critical": 0, "standard": 0, "sheddable": 0}'  # decide at once
        )
    if spec.order != "fair" or not spec.feedback:
        raise ValueError(f"{spec.label}: live runs take kvgate's configuration only")
    return env


async def _model_of(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        data = await r.json()
    return str(data["data"][0]["id"])


async def _wait_idle(engines: list[str], timeout_s: float = 60.0) -> None:
    """Wait until no engine runs or queues anything (the previous run's aborts landed)."""
    deadline = time.monotonic() + timeout_s
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            busy = 0.0
            for e in engines:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(e + "/metrics") as r:
                        busy += sum(parse_metrics(await r.text(), names).values())
            if busy == 0:
                return
            await asyncio.sleep(0.5)


def _play(spec: RunSpec, target: LiveTarget) -> RunResult:
    arrivals = generate(spec.shape, spec.nodes, spec.duration_s, spec.load, spec.seed)
    bursts = burst_times(spec.shape, spec.duration_s)
    options = LiveOptions(
        policy=spec.label,
        load=spec.load,
        seed=spec.seed,
        preset=spec.preset,
        duration_s=spec.duration_s,
        warmup_s=spec.warmup_s,
        slo=spec.slo,
        bursts=bursts,
    )
    return asyncio.run(run_live(arrivals, spec.client, target, options))


def _with_gateway(
    spec: RunSpec, engines: list[str], zombie_counter: bool, scrape_s: float
) -> RunResult:
    """Run `spec` against `engines`, through a fresh `kvgate serve` unless it is `direct`."""
    model = asyncio.run(_model_of(engines[0]))
    if spec.label == "direct":
        target = LiveTarget(engines, engines, model, zombie_counter)
        return _play(spec, target)
    port = free_port()
    gw = start(
        _gateway_cmd(spec),
        "kvgate serve",
        LOGS / f"serve-{spec.label}-{spec.load:g}.log",
        _gateway_env(spec, engines, port, scrape_s),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url + "/healthz", gw, 30.0))
        asyncio.run(asyncio.sleep(1.0))  # a few scrapes, so nodes are fresh
        return _play(spec, LiveTarget([url], engines, model, zombie_counter, gateway=url))
    finally:
        gw.stop()


def _sim_run(spec: RunSpec, scrape_s: float) -> RunResult:
    """live-sim: fresh `kvgate sim` engines (cancellation per the spec) for every run."""
    port = free_port(spec.nodes)
    args = ["sim", "--port", str(port), "--nodes", str(spec.nodes), "--preset", spec.preset]
    if not spec.cancel:
        args.append("--no-abort-on-disconnect")
    sim = start(kvgate_cmd(*args), "kvgate sim", LOGS / f"sim-{spec.label}-{spec.load:g}.log")
    engines = [f"http://127.0.0.1:{port + i}" for i in range(spec.nodes)]
    try:
        for e in engines:
            asyncio.run(wait_healthy(e + "/health", sim, 30.0))
        return _with_gateway(spec, engines, True, scrape_s)
    finally:
        sim.stop()


@contextlib.contextmanager
def _real_vllm() -> Iterator[list[str]]:
    """The real vLLM CPU engine, started under the lock and always stopped."""
    from kvgate.bench.driver import REAL_VLLM_SERVE, real_vllm_lock

    with real_vllm_lock():
        port = free_port()
        proc: Proc = start(
            ["bash", str(REAL_VLLM_SERVE), str(port)], "real vLLM", LOGS / "real-vllm.log"
        )
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(wait_healthy(url + "/health", proc, 240.0))
            yield [url]
        finally:
            proc.stop(grace_s=20.0)


@contextlib.contextmanager
def live_runner(opts: object) -> Iterator[Callable[[RunSpec], RunResult]]:
    """A runner for the grid: live-sim starts engines per run, live-vllm once for all."""
    mode = getattr(opts, "mode", "live-sim")
    scrape_s = float(getattr(opts, "scrape_s", 0.05))
    if mode == "live-sim":
        yield lambda spec: _sim_run(spec, scrape_s)
        return
    with _real_vllm() as engines:

        def run(spec: RunSpec) -> RunResult:
            asyncio.run(_wait_idle(engines))
            # No zombie counter on a real engine: zombies = generated - delivered.
            result = _with_gateway(replace(spec), engines, False, scrape_s)
            result.extra.setdefault("notes", []).insert(
                0,
                "real vLLM: it has no zombie counter, so `zombie tok` is an upper bound: "
                "tokens the engine generated that no client read, less those kvgate had "
                "already relayed to clients that were still connected (made before they "
                "left); see the zombie accounting lines. Clients count tokens exactly "
                "(`return_token_ids`: vLLM merges tokens into one event when its server "
                "lags). Preemptions are vLLM's own counter, which counts a preemption "
                "only when the request runs again",
            )
            return result

        yield run
