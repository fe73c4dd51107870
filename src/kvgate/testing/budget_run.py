"""A tenant's budget held by live replicas: the run that `benchmarks/budgets/` reports and
a test of the suite repeats at a smaller scale.

`run_budget(BudgetLoad(...))` starts simulated engines (`kvgate sim`), a redis-server and
`replicas` `kvgate serve` processes sharing it, one tenant whose key has a budget of
`tokens_per_minute`, and `clients` clients that send streamed completions for `seconds`
(spread over the replicas, each client on one): prompts of token ids (counted exactly by
kvgate and the engine), `ignore_eos` (every request uses all it reserved), each with
`X-Kvgate-Max-Wait-Ms`. A client whose request is refused sleeps what the answer's
`retry-after-ms` says, as the `openai` SDK does, and sends another. With `store_down`, the
redis-server is killed at its first second and started again, empty, at its second.

`BudgetRun` judges the answers against the one true bucket, rebuilt from what the clients
saw and the gateways' access lines: each 200 reserved its prompt + `max_tokens` when its
gateway admitted it and used what its `usage` says when it ended. Its figures:

- `served`: the tokens the engines reported for the requests that started within the run,
  against `bound` = the budget x (1 + seconds / 60);
- `lowest`: the least the true bucket held (below 0: overspent), two estimates;
- each budget refusal's `retry_after_s` against its `real_wait_s`: the time the true
  bucket's refill takes to cover it and the tenant's requests waiting before it then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from kvgate.procs.children import die_with_parent, stop_async
from kvgate.procs.ports import free_port
from kvgate.procs.redis_server import RedisServer
from kvgate.testing.polling import until_ready

KEY = "budget-run-key-0123456789abcdef"
ADMIN = "budget-run-admin-0123456789abcdef"
TENANT = "acme"
MODEL = "sim-llama"


@dataclass(frozen=True)
class BudgetLoad:
    """What `run_budget` runs (see the module docstring)."""

    replicas: int = 3
    tokens_per_minute: int = 20_000
    clients: int = 60
    seconds: float = 70.0
    engines: int = 2
    prompt: tuple[int, int] = (100, 300)  # token ids, uniform
    output: tuple[int, int] = (100, 500)  # max_tokens, uniform
    max_wait_ms: int = 2000
    store_down: tuple[float, float] | None = None  # killed at, started again at (s)
    seed: int = 0


@dataclass
class Answer:
    """One request as its client saw it, and when its gateway took it and decided (from
    its access line: when it was written, less the request's time there, plus its wait).
    Times on the client's monotonic clock."""

    id: str
    sent: float
    cost: int  # prompt + max_tokens: what it reserves
    status: int = 0
    reason: str = ""
    ended: float = 0.0
    used: int = 0  # prompt + completion, as the engine's usage said
    retry_after_s: float = 0.0
    remaining: int = 0  # its x-ratelimit-remaining-tokens
    head: float = 0.0  # its head arrived (a 200's admission came before)
    came: float = 0.0  # the gateway received it
    decided: float = 0.0  # the gateway admitted or refused it

    def place(self, end: float, total_s: float, queue_s: float | None) -> None:
        self.came = end - total_s
        self.decided = self.came + (queue_s or 0.0)


@dataclass(frozen=True)
class Refusal:
    at: float  # seconds into the run
    retry_after_s: float
    real_wait_s: float

    @property
    def error(self) -> float:
        """How far the Retry-After is from the real wait, as a fraction of it."""
        return abs(self.retry_after_s - self.real_wait_s) / max(self.real_wait_s, 1e-9)


@dataclass
class BudgetRun:
    """A run's answers and what they tell (see the module docstring)."""

    load: BudgetLoad
    start: float
    answers: list[Answer] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.load.tokens_per_minute / 60.0

    @property
    def bound(self) -> float:
        return self.load.tokens_per_minute * (1 + self.load.seconds / 60.0)

    @property
    def served(self) -> int:
        """Tokens used by the requests that started within the run (those that waited in
        a queue past its end started on the refill after it)."""
        end = self.start + self.load.seconds
        return sum(a.used for a in self.answers if a.status == 200 and a.decided <= end)

    def count(self, status: int, reason: str | None = None) -> int:
        return sum(
            1 for a in self.answers if a.status == status and (reason is None or a.reason == reason)
        )

    @property
    def others(self) -> list[Answer]:
        """Answers neither served nor refused with a 429 and a Retry-After."""
        return [
            a for a in self.answers if a.status != 200 and not (a.status == 429 and a.retry_after_s)
        ]

    def _events(self, late: bool) -> list[tuple[float, int, float, float]]:
        """(time, order, reserved change, used) of every 200, in time order: a settle
        before a reservation at the same instant. Each is reserved when its gateway decided
        (`late`: when its head came, the latest its admission can have been)."""
        events = []
        for a in self.answers:
            if a.status == 200:
                at = max(a.decided, a.head) if late else a.decided
                events.append((at, 1, float(a.cost), 0.0))
                events.append((a.ended, 0, -float(a.cost), float(a.used)))
        return sorted(events)

    def _free_at(self, moments: list[float], late: bool = False) -> tuple[list[float], float]:
        """The true bucket's free tokens at each of `moments` (sorted), and its lowest."""
        level, reserved, at = float(self.load.tokens_per_minute), 0.0, self.start
        lowest = level
        out: list[float] = []
        pending = iter(moments)
        moment = next(pending, None)
        for when, _, change, used in self._events(late):
            while moment is not None and moment <= when:
                out.append(_refilled(level, reserved, at, moment, self) - reserved)
                moment = next(pending, None)
            level = _refilled(level, reserved, at, when, self)
            at = when
            reserved += change
            level -= used
            lowest = min(lowest, level - reserved)
        while moment is not None:
            out.append(_refilled(level, reserved, at, moment, self) - reserved)
            moment = next(pending, None)
        return out, lowest

    @property
    def lowest(self) -> tuple[float, float]:
        """The true bucket's lowest level, rebuilt with each admission placed when its
        gateway decided (the line's time less the request's time there, plus its wait:
        early by the time the gateway took to read the request) and when its head came
        (late). Two estimates, not bounds: a bucket full to its ceiling wastes refill
        while reservations are placed late."""
        return self._free_at([])[1], self._free_at([], late=True)[1]

    def refusals(self) -> list[Refusal]:
        """Every budget refusal against the true bucket's refill for it."""
        refused = sorted(
            (a for a in self.answers if (a.status, a.reason) == (429, "tenant_budget")),
            key=lambda a: a.decided,
        )
        frees, _ = self._free_at([a.decided for a in refused])
        out = []
        for answer, free in zip(refused, frees, strict=True):
            ahead = sum(
                a.cost for a in self.answers if a.came < answer.came and a.decided > answer.decided
            )
            real = max(0.0, ahead + answer.cost - free) / self.rate
            out.append(Refusal(answer.decided - self.start, answer.retry_after_s, real))
        return out


def _refilled(level: float, reserved: float, at: float, now: float, run: BudgetRun) -> float:
    ceiling = run.load.tokens_per_minute + reserved
    return level if level >= ceiling else min(ceiling, level + run.rate * max(0.0, now - at))


# ---- processes ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


@contextlib.asynccontextmanager
async def _cluster(load: BudgetLoad, store: str, logs: Path) -> AsyncIterator[list[str]]:
    """Engines and `load.replicas` gateways on `store`, all ready and in sync; each
    gateway's log (its access lines, JSON) in `logs`."""
    base = free_port(load.engines)
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate", "sim", "--nodes", str(load.engines),
            "--preset", "gpu-8b", "--port", str(base), "--model-name", MODEL,
            stdout=asyncio.subprocess.DEVNULL, env=_env(), preexec_fn=die_with_parent,
        )
    ]  # fmt: skip
    engines = [f"http://127.0.0.1:{base + i}" for i in range(load.engines)]
    config = {
        "server": {"admin_token": ADMIN, "log_level": "info", "log_format": "json"},
        "auth": {
            "keys": [{"key": KEY, "tenant": TENANT}],
            "tenants": {TENANT: {"tokens_per_minute": load.tokens_per_minute}},
        },
        "store": {"url": store},
        "backends": [{"url": url} for url in engines],
    }
    path = logs / "kvgate.json"
    path.write_text(json.dumps(config))
    urls = []
    try:
        for i in range(load.replicas):
            port = free_port()
            with (logs / f"replica{i}.log").open("wb") as log:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "kvgate", "serve", "--config", str(path),
                        "--port", str(port), stdout=log, stderr=log, env=_env(),
                        preexec_fn=die_with_parent,
                    )
                )  # fmt: skip
            urls.append(f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient(timeout=2.0) as client:
            for url in urls:
                await until_ready(functools.partial(_ready, client, url, load), 60.0, url)
        yield urls
    finally:
        for process in processes:
            await stop_async(process)


def _place(answers: list[Answer], logs: Path, offset: float) -> None:
    """Place every answer by its access line: when its gateway took and decided it
    (`offset`: the wall clock less the monotonic one)."""
    lines: dict[str, dict[str, Any]] = {}
    for log in logs.glob("replica*.log"):
        for line in log.read_bytes().splitlines():
            if b'"logger":"kvgate.access"' in line:
                record = json.loads(line)
                lines[str(record.get("id"))] = record
    for answer in answers:
        record = lines.get(answer.id)
        if record is not None and record.get("total_s") is not None:
            end = _wall(str(record["time"])) - offset
            answer.place(end, float(record["total_s"]), record.get("queue_s"))


def _wall(stamp: str) -> float:
    """A log line's time (`2026-12-01T14:40:07.123Z`) in seconds since the epoch."""
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


async def _ready(client: httpx.AsyncClient, url: str, load: BudgetLoad) -> bool:
    answer = await client.get(f"{url}/admin/state", headers={"authorization": f"Bearer {ADMIN}"})
    state = answer.json()
    nodes = state["policy"]["nodes"]
    fresh = len(nodes) == load.engines and all(node["fresh"] for node in nodes.values())
    cluster = state["cluster"]
    return bool(fresh and cluster["state"] == "synced" and cluster["replicas"] == load.replicas)


# ---- clients ----------------------------------------------------------------------------------


async def _one(
    client: httpx.AsyncClient, url: str, load: BudgetLoad, rng: random.Random, rid: str
) -> Answer:
    prompt = rng.randint(*load.prompt)
    output = rng.randint(*load.output)
    body = {
        "model": MODEL,
        "prompt": [rng.randrange(1000, 30000) for _ in range(prompt)],
        "max_tokens": output,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-api-key": KEY, "x-kvgate-max-wait-ms": str(load.max_wait_ms), "x-request-id": rid}
    answer = Answer(rid, sent=time.monotonic(), cost=prompt + output)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            answer.head = time.monotonic()
            answer.status = r.status_code
            answer.remaining = int(r.headers.get("x-ratelimit-remaining-tokens", "-1"))
            if r.status_code != 200:
                await r.aread()
                answer.reason = r.headers.get("x-kvgate-reason", "")
                answer.retry_after_s = int(r.headers.get("retry-after-ms", "0")) / 1000
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            answer.used = int(usage["total_tokens"])
    except httpx.HTTPError as exc:
        answer.status, answer.reason = -1, type(exc).__name__
    answer.ended = time.monotonic()
    answer.came = answer.decided = answer.sent  # until its access line tells
    return answer


async def _client(
    index: int, urls: list[str], load: BudgetLoad, run: BudgetRun, client: httpx.AsyncClient
) -> None:
    rng = random.Random(load.seed * 1000 + index)
    url = urls[index % len(urls)]
    end = run.start + load.seconds
    await asyncio.sleep(rng.uniform(0.0, 0.5))  # not all at one instant
    for n in itertools.count():
        if time.monotonic() >= end:
            return
        answer = await _one(client, url, load, rng, f"c{index}-{n}")
        run.answers.append(answer)
        if answer.status == 429:
            pause = answer.retry_after_s
        elif answer.status == 200:
            pause = 0.0
        else:
            pause = 0.5
        await asyncio.sleep(min(pause, max(0.0, end - time.monotonic())))


async def _store_outage(redis: list[RedisServer], load: BudgetLoad, start: float) -> None:
    if load.store_down is None:
        return
    down, up = load.store_down
    await asyncio.sleep(max(0.0, start + down - time.monotonic()))
    port = redis[0].port
    redis[0].kill()
    await asyncio.sleep(max(0.0, start + up - time.monotonic()))
    redis[0] = await asyncio.to_thread(RedisServer.start, port=port)


async def run_budget(load: BudgetLoad) -> BudgetRun:
    """Run `load` (see the module docstring) and return what the clients saw."""
    redis = [RedisServer.start(port=0)]
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-budget-") as tmp:
            logs = Path(tmp)
            async with _cluster(load, redis[0].url, logs) as urls:
                limits = httpx.Limits(max_connections=load.clients * 2)
                async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
                    offset = time.time() - time.monotonic()
                    run = BudgetRun(load, time.monotonic())
                    outage = asyncio.create_task(_store_outage(redis, load, run.start))
                    await asyncio.gather(
                        *(_client(i, urls, load, run, client) for i in range(load.clients))
                    )
                    await outage
            _place(run.answers, logs, offset)
        return run
    finally:
        redis[0].stop()
