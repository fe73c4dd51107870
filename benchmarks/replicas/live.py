"""Gateway replicas, live: N `kvgate serve` processes sharing one redis-server, against N
independent ones, in front of the same simulated engines, on the same burst.

Every configuration gets fresh engines (`kvgate sim --nodes 4 --preset cpu-tiny`: 4,096
KV tokens each, in one process) and fresh gateways:

- `independent`: N `kvgate serve` processes, no store: each admits by its own books and
  the engines' samples (what N replicas did before they shared anything);
- `shared`: the same N processes with `--store` on one redis-server of this benchmark's:
  they exchange views every 50 ms and each fills only its share of a node's room.

The burst, sent open-loop by this script (one request at each arrival, never retried;
requests spread round-robin over the replicas): 2 s at `--rate` requests/s, then 6 s at a
sixth of it; prompts of ~800 tokens (text), 300 output tokens with `ignore_eos`, streamed.
One request holds ~1,100 of an engine's 4,096 tokens at its end, so an engine holds three
under the panic watermark (0.92) and a fourth makes it preempt.

Measured per configuration:

- peak KV: the highest `vllm:kv_cache_usage_perc` of any engine, each engine's page polled
  every 25 ms by this script;
- preemptions: the engines' `vllm:num_preemptions_total` at the end (fresh engines);
- goodput: output tokens of the requests answered whole (200, `[DONE]`, every token),
  over the time from the first arrival to the last answer; and how many were served;
- refusals (429) and anything else.

Writes its table into `results.md` (the section after `## Live`), replacing an older one.

    .venv/bin/python benchmarks/replicas/live.py [--rounds 2] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import httpx

from kvgate.procs.children import die_with_parent, stop_async
from kvgate.procs.redis_server import RedisServer
from kvgate.testing import free_port
from kvgate.testing.polling import until_ready

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.md"
SECTION = "## Live"
ENGINES = 4
REPLICAS = (1, 2, 4)
PROMPT_CHARS = 3200  # ~800 tokens at the simulator's 4 characters per token
OUTPUT_TOKENS = 300
BURST_S, TAIL_S = 2.0, 6.0
POLL_S = 0.025
CLIENT_TIMEOUT_S = 180.0
_KV = re.compile(rb"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.M)
_PREEMPT = re.compile(rb"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", re.M)


@dataclass
class Answer:
    status: int
    tokens: int = 0
    done: bool = False
    sent_at: float = 0.0
    ended_at: float = 0.0


@dataclass
class Run:
    replicas: int
    mode: str
    round: int = 0
    peak_kv: float = 0.0
    preemptions: int = 0
    answers: list[Answer] = field(default_factory=list)

    @property
    def served(self) -> list[Answer]:
        return [a for a in self.answers if a.status == 200 and a.done and a.tokens >= OUTPUT_TOKENS]

    @property
    def goodput(self) -> float:
        if not self.answers:
            return 0.0
        start = min(a.sent_at for a in self.answers)
        end = max(a.ended_at for a in self.answers)
        return sum(a.tokens for a in self.served) / max(1e-9, end - start)

    def count(self, status: int) -> int:
        return sum(1 for a in self.answers if a.status == status)


# ---- processes ------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


async def start_engines() -> tuple[asyncio.subprocess.Process, list[str]]:
    """`kvgate sim` with ENGINES cpu-tiny engines on free consecutive ports."""
    base = free_port(ENGINES)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate", "sim", "--nodes", str(ENGINES), "--preset", "cpu-tiny",
        "--port", str(base), "--model-name", "sim-llama",
        stdout=asyncio.subprocess.DEVNULL, env=_env(), preexec_fn=die_with_parent,
    )  # fmt: skip
    urls = [f"http://127.0.0.1:{base + i}" for i in range(ENGINES)]
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in urls:
            await until_ready(lambda u=url: _ok(client, f"{u}/health"), 30.0, f"engine {url}")
    return process, urls


async def start_gateways(
    n: int, engines: list[str], store: str | None
) -> list[tuple[str, asyncio.subprocess.Process]]:
    out = []
    backends = [part for url in engines for part in ("--backend", url)]
    for _ in range(n):
        port = free_port()
        extra = ["--store", store] if store else []
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate", "serve", "--port", str(port),
            "--log-level", "warning", *extra, *backends,
            stdout=asyncio.subprocess.DEVNULL, env=_env(), preexec_fn=die_with_parent,
        )  # fmt: skip
        out.append((f"http://127.0.0.1:{port}", process))
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url, _ in out:
            await until_ready(lambda u=url: _ready(client, u, n, store is not None), 60.0, url)
    return out


async def _ready(client: httpx.AsyncClient, url: str, n: int, shared: bool) -> bool:
    """Serving, every engine fresh, and (shared) every replica in sync with all others."""
    state = (await client.get(f"{url}/admin/state")).json()
    nodes = state["policy"]["nodes"]
    if len(nodes) < ENGINES or not all(node["fresh"] for node in nodes.values()):
        return False
    cluster = state["cluster"]
    return not shared or (cluster["state"] == "synced" and cluster["replicas"] == n)


async def _ok(client: httpx.AsyncClient, url: str) -> bool:
    return (await client.get(url)).status_code == 200


# ---- load and watching ------------------------------------------------------------------------


def arrivals(rate: float, seed: int) -> list[float]:
    """Poisson arrival times: BURST_S at `rate`, then TAIL_S at rate / 6."""
    rng = random.Random(seed)
    out: list[float] = []
    for start, end, r in ((0.0, BURST_S, rate), (BURST_S, BURST_S + TAIL_S, rate / 6)):
        t = start + rng.expovariate(r)
        while t < end:
            out.append(t)
            t += rng.expovariate(r)
    return out


def prompt(rng: random.Random) -> str:
    words = []
    size = 0
    while size < PROMPT_CHARS:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:PROMPT_CHARS]


async def one_request(client: httpx.AsyncClient, url: str, text: str) -> Answer:
    body = {
        "model": "sim-llama",
        "prompt": text,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    answer = Answer(status=0, sent_at=time.monotonic())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            answer.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: [DONE]"):
                    answer.done = True
                elif line.startswith("data: ") and '"text"' in line:
                    answer.tokens += 1
    except httpx.HTTPError:
        answer.status = -1
    answer.ended_at = time.monotonic()
    return answer


async def watch(engines: list[str], run: Run, stop_at: asyncio.Event) -> None:
    """Poll every engine's page: the highest KV usage seen, the last preemption count."""
    preempted = [0] * len(engines)
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            for i, url in enumerate(engines):
                with contextlib.suppress(httpx.HTTPError):
                    page = (await client.get(f"{url}/metrics")).content
                    kv = _KV.search(page)
                    if kv is not None:
                        run.peak_kv = max(run.peak_kv, float(kv.group(1)))
                    count = _PREEMPT.search(page)
                    if count is not None:
                        preempted[i] = int(float(count.group(1)))
            run.preemptions = sum(preempted)
            if stop_at.is_set():
                return
            await asyncio.sleep(POLL_S)


async def one_run(n: int, mode: str, rate: float, seed: int, redis: RedisServer) -> Run:
    run = Run(n, mode, seed)
    sim, engines = await start_engines()
    gateways: list[tuple[str, asyncio.subprocess.Process]] = []
    try:
        gateways = await start_gateways(n, engines, redis.url if mode == "shared" else None)
        await asyncio.sleep(1.0)  # a few syncs and scrapes with nothing running
        times = arrivals(rate, seed)
        rng = random.Random(seed)
        texts = [prompt(rng) for _ in times]
        finished = asyncio.Event()
        watcher = asyncio.create_task(watch(engines, run, finished))
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
            start = time.monotonic()
            tasks = []
            for i, (at, text) in enumerate(zip(times, texts, strict=True)):
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                url = gateways[i % n][0]
                tasks.append(asyncio.create_task(one_request(client, url, text)))
            run.answers = list(await asyncio.gather(*tasks))
        await asyncio.sleep(0.2)
        finished.set()
        await watcher
    finally:
        for _, process in gateways:
            await stop_async(process)
        await stop_async(sim)
        with contextlib.suppress(Exception):
            await redis_flush(redis)
    return run


async def redis_flush(redis: RedisServer) -> None:
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(redis.url)
    try:
        await client.flushdb()
    finally:
        await client.aclose()


# ---- the report -------------------------------------------------------------------------------


def table(runs: list[Run], rounds: int, rate: float) -> list[str]:
    keys = sorted({(r.replicas, r.mode) for r in runs}, key=lambda k: (k[0], k[1]))
    # Goodput against one replica's on the same burst (each round has its own seed).
    one = {r.round: r.goodput for r in runs if r.replicas == 1 and r.mode == "shared"}
    lines = [
        "| replicas | books | peak KV (median, max) | preemptions (median, max) | goodput tok/s"
        " | vs one replica | served | 429 | other |",
        "|---|---|---|---|---:|---:|---|---:|---:|",
    ]
    for n, mode in keys:
        rs = [r for r in runs if r.replicas == n and r.mode == mode]
        peaks = [r.peak_kv for r in rs]
        pre = [r.preemptions for r in rs]
        good = statistics.median(r.goodput for r in rs)
        ratio = statistics.median(r.goodput / one[r.round] for r in rs if one.get(r.round))
        served = statistics.median(len(r.served) for r in rs)
        total = statistics.median(len(r.answers) for r in rs)
        refused = statistics.median(r.count(429) for r in rs)
        other = statistics.median(len(r.answers) - len(r.served) - r.count(429) for r in rs)
        lines.append(
            f"| {n} | {mode} | {statistics.median(peaks):.3f}, {max(peaks):.3f} | "
            f"{statistics.median(pre):.0f}, {max(pre)} | {good:,.0f} | "
            f"{ratio:.1%} | {served:.0f} / {total:.0f} | {refused:.0f} | {other:.0f} |"
        )
    return lines


def write(runs: list[Run], args: argparse.Namespace, load: tuple[float, float]) -> None:
    requests = len(arrivals(args.rate, 0))
    head = [
        SECTION,
        "",
        f"Command: `python benchmarks/replicas/live.py --rounds {args.rounds} --rate {args.rate:g}`"
        f" ({date.today().isoformat()}, {os.cpu_count()} CPUs shared by every process here,"
        f" Python {platform.python_version()}; load average {load[0]:.2f} before,"
        f" {load[1]:.2f} after). Four `cpu-tiny` engines (`kvgate sim`, 4,096 KV tokens each)"
        f" and fresh gateways per run; a burst of {BURST_S:g} s at {args.rate:g} requests/s then"
        f" {TAIL_S:g} s at {args.rate / 6:.3g}/s (~{requests} requests with seed 0), ~800-token"
        f" prompts, {OUTPUT_TOKENS} output tokens (ignore_eos), streamed, sent once each and"
        f" spread round-robin over the replicas; `shared`: `--store` on one redis-server."
        f" Median over {args.rounds} rounds (configurations interleaved in each round; round"
        " k's burst has seed k); goodput against one replica's (`1 shared`) on the same"
        " burst.",
        "",
        *table(runs, args.rounds, args.rate),
        "",
    ]
    text = RESULTS.read_text() if RESULTS.exists() else ""
    before, _, rest = text.partition(SECTION)
    after = ""
    if rest:
        nxt = rest.find("\n## ", 1)
        after = rest[nxt + 1 :] if nxt >= 0 else ""
    text = before.rstrip("\n") + "\n\n" + "\n".join(head)
    RESULTS.write_text(text + ("\n" + after if after else ""))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--replicas", default=",".join(map(str, REPLICAS)))
    parser.add_argument("--dry", action="store_true", help="print, do not write results.md")
    args = parser.parse_args()
    counts = [int(x) for x in args.replicas.split(",")]
    runs: list[Run] = []
    load_before = os.getloadavg()[0]
    with RedisServer.start(port=0) as redis:
        for round_ in range(args.rounds):
            for n in counts:
                for mode in ("independent", "shared"):
                    run = await one_run(n, mode, args.rate, round_, redis)
                    runs.append(run)
                    print(
                        f"round {round_} {n} {mode}: peak {run.peak_kv:.3f}, preemptions"
                        f" {run.preemptions}, goodput {run.goodput:,.0f} tok/s, served"
                        f" {len(run.served)}/{len(run.answers)}, 429 {run.count(429)}",
                        flush=True,
                    )
    print("\n".join(table(runs, args.rounds, args.rate)))
    if not args.dry:
        write(runs, args, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    asyncio.run(main())
