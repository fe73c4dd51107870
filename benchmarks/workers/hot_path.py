"""What the shared store adds to a request's admission: latency, and Redis round trips.

A replica's admission core (`FlowController`, policy `adaptive`) runs in one asyncio loop,
fed engine samples every 50 ms for 4 engines as the scraper feeds them, and takes a steady
stream of requests (Poisson arrivals at `--rate`, each admitted and released after
`--hold` s, never waiting: the engines are large). Two modes, alternated `--rounds` times:

- `alone`: no store (kvgate without `store.url`);
- `store`: the same loop also runs the real sync task (`kvgate.cluster.sync.ClusterSync`)
  against a real redis-server, where 3 peer replicas (another process, the same core and
  sync task, each holding ~`--rate * --hold / 4` live requests) publish their views. So
  every 50 ms this replica encodes its view, runs the exchange, decodes 3 peers' views and
  folds their holds into every node's envelope, and each admission plans the peers'
  requests too.

Measured per mode:

- **admission latency**: from the moment a request is due (its arrival time on the loop's
  clock) to the moment `submit()` has decided. It includes the time the request waited for
  the loop, so a sync tick that holds the loop shows here; p50, p99, p99.9 and max;
- **`submit()` itself**: the time the call takes (what admission costs once the loop runs
  it), p50 and p99;
- **Redis round trips**: the server's round trips (`INFO commandstats`: EVALSHA, EVAL and
  SCRIPT LOAD, the commands a client sends; the script's own commands are not round
  trips), per second over the loaded phase and over an idle phase of the same length (the
  peers and the sync task running, no requests): the difference per admitted request is
  what requests add. And this replica's own exchanges per second (its sync task's count);
- each sync tick's work (building and encoding its view, reading each peer's, then
  folding them into the core) and the longest of those pieces, which is how long the tick
  holds the loop at once (it yields between them), p50 and p99;
- the loop's CPU per request (the whole benchmark process: loop, sync task, samples).

    .venv/bin/python benchmarks/workers/hot_path.py [--rounds 3] [--rate 400] [--seconds 15]

Writes its section of `results.md` (after `## Admission latency with the store`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from kvgate.cluster.redis_store import RedisStore
from kvgate.cluster.sync import ClusterSync
from kvgate.core.admission import Admit, Decision, Outcome
from kvgate.core.clock import MonotonicClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.procs.children import die_with_parent
from kvgate.procs.redis_server import RedisServer

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.md"
SECTION = "## Admission latency with the store"
NODES = [f"engine-{i}" for i in range(4)]
CAPACITY = 368_000  # a gpu-8b engine's KV tokens: nothing ever waits
SAMPLE_PERIOD_S = 0.05
PEERS = 3
ROUND_TRIPS = ("evalsha", "eval", "script|load")  # what clients send; not the script's own


def core(replica: str) -> FlowController:
    clock = MonotonicClock()
    policy = build_policy(AdmissionSettings(), clock)
    flow = FlowController(policy, replica=replica)
    for node in NODES:
        flow.add_node(node)
    return flow


async def feed_samples(flows: list[FlowController], stop: asyncio.Event) -> None:
    """Every 50 ms a sample of every engine (30 % used), as the scraper delivers them."""
    clock = MonotonicClock()
    while not stop.is_set():
        for flow in flows:
            for node in NODES:
                flow.observe(node, NodeSample(0.3, CAPACITY, 40, 0, 0.02, clock.now()))
        await asyncio.sleep(SAMPLE_PERIOD_S)


def request(rng: random.Random, rid: int) -> AdmissionRequest:
    prompt = rng.randint(200, 2000)
    return AdmissionRequest(str(rid), RequestCost(prompt, 256), model="m", candidates=tuple(NODES))


async def load(
    flow: FlowController, rate: float, hold: float, seconds: float, seed: int
) -> tuple[list[float], list[float], int, int]:
    """Poisson arrivals at `rate` for `seconds`: each admission's latency (s) from when it
    was due to its decision, how long each `submit()` took, how many were admitted and how
    many of them had to wait (the engines are large: none is refused)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)

    def decided(decision: Decision, due: float) -> None:
        nonlocal admitted
        latencies.append(loop.time() - due)
        if isinstance(decision, Admit):
            admitted += 1
            loop.call_later(hold, flow.release, decision.ticket, Outcome.DONE)
        else:
            refused[decision.reason] = refused.get(decision.reason, 0) + 1

    latencies: list[float] = []
    durations: list[float] = []
    admitted = waited = 0
    refused: dict[str, int] = {}
    start = loop.time()
    due = start
    rid = 0
    while True:
        due += rng.expovariate(rate)
        if due - start >= seconds:
            break
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        rid += 1
        item = request(rng, rid)
        began = time.perf_counter()
        decision = flow.submit(item)
        durations.append(time.perf_counter() - began)
        if isinstance(decision, Waiter):  # this replica's share is spent until the next sync
            waited += 1
            decision.notify = lambda d, due=due: decided(d, due)
            continue
        decided(decision, due)
    await asyncio.sleep(hold + 0.1)  # every release done
    if admitted < rid:  # the engines are large: only a stalled machine makes this happen
        print(f"  {rid - admitted} of {rid} requests not admitted: {refused}", flush=True)
    return latencies, durations, admitted, waited


@contextlib.asynccontextmanager
async def synced(flow: FlowController, url: str, name: str):  # type: ignore[no-untyped-def]
    sync = ClusterSync(
        RedisStore(url, client_name=name), flow, flow, MonotonicClock(),
        nodes=lambda: NODES, member_id=name,
    )  # fmt: skip
    flow.exchange.replica = name
    task = asyncio.create_task(sync.run())
    try:
        yield sync
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- the peers' process ------------------------------------------------------------------------


async def peers_main(url: str, rate: float, hold: float) -> None:
    """PEERS replicas in this process, each with a steady load of its own, until killed."""
    flows = [core(f"peer-{i}") for i in range(PEERS)]
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        for i, flow in enumerate(flows):
            await stack.enter_async_context(synced(flow, url, f"peer-{i}"))
        feeder = asyncio.create_task(feed_samples(flows, stop))
        while True:  # killed by the parent
            await asyncio.gather(
                *(load(f, rate / 4, hold, 600.0, 100 + i) for i, f in enumerate(flows))
            )
        feeder.cancel()


# ---- the measuring process ---------------------------------------------------------------------


@dataclass
class Phase:
    mode: str
    latencies: list[float]
    durations: list[float]
    admitted: int
    waited: int  # admitted after waiting in the queue (for the next sync's share)
    seconds: float  # each phase's length (idle and loaded alike)
    commands: int
    idle_commands: int
    own_idle: int  # this replica's exchanges while idle, and while loaded
    own_loaded: int
    cpu_s: float
    ticks: list[float]  # each sync tick's work (encode, read the peers' views, apply)
    holds: list[float]  # the longest piece of each tick (it yields to the loop between)

    def pct(self, q: float, of: str = "latencies") -> float:
        ordered = sorted(getattr(self, of))
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def per_s(self) -> float:
        return self.commands / self.seconds

    @property
    def idle_per_s(self) -> float:
        return self.idle_commands / self.seconds

    @property
    def per_request(self) -> float:
        return (self.commands - self.idle_commands) / max(1, self.admitted)


async def commands(url: str) -> int:
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ROUND_TRIPS)


async def phase(mode: str, url: str, args: argparse.Namespace, seed: int) -> Phase:
    flow = core("bench")
    stop = asyncio.Event()
    feeder = asyncio.create_task(feed_samples([flow], stop))
    async with contextlib.AsyncExitStack() as stack:
        sync = None
        if mode == "store":
            sync = await stack.enter_async_context(synced(flow, url, "bench"))

        def own() -> int:
            return 0 if sync is None else sync.stats.exchanges_total

        ticks: list[float] = []
        holds: list[float] = []
        if sync is not None:
            time_ticks(sync, ticks, holds)

        await asyncio.sleep(1.0)  # a few syncs first
        length = args.seconds + args.hold + 0.1  # the load's length, its releases included
        before, mine = await commands(url), own()
        await asyncio.sleep(length)  # idle: syncs and samples only
        idle, own_idle = await commands(url) - before, own() - mine
        cpu0 = time.process_time()
        before, mine = await commands(url), own()
        latencies, durations, admitted, waited = await load(
            flow, args.rate, args.hold, args.seconds, seed
        )
        loaded, own_loaded = await commands(url) - before, own() - mine
        cpu = time.process_time() - cpu0
    stop.set()
    await feeder
    return Phase(
        mode, latencies, durations, admitted, waited, length, loaded, idle, own_idle,
        own_loaded, cpu, ticks or [0.0], holds or [0.0],
    )  # fmt: skip


def time_ticks(sync: ClusterSync, into: list[float], holds: list[float]) -> None:
    """Record each tick's own work (`into`: building and encoding the view, reading each
    peer's, applying them) and the longest of its pieces (`holds`: the tick yields to the
    loop between them, so this is the longest a request due during a tick can wait)."""
    outgoing, read, apply = sync.outgoing, sync._read, sync._apply
    pieces: list[float] = []

    def timed(fn: Callable[..., Any], last: bool = False) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            began = time.perf_counter()
            out = fn(*args)
            pieces.append(time.perf_counter() - began)
            if last:
                into.append(sum(pieces))
                holds.append(max(pieces))
                pieces.clear()
            return out

        return run

    sync.outgoing = timed(outgoing)  # type: ignore[method-assign]
    sync._read = timed(read)  # type: ignore[method-assign]
    sync._apply = timed(apply, last=True)  # type: ignore[method-assign]


def table(phases: list[Phase]) -> list[str]:
    lines = [
        "| mode | requests | waited | due to decided p50 ms | p99 ms | p99.9 ms | max ms |"
        " `submit()` p50 ms | p99 ms | round trips/s, idle | loaded | per request |"
        " this replica's exchanges/s, idle | loaded | a tick's work, p50 ms | p99 ms |"
        " its longest hold of the loop, p50 ms | p99 ms | CPU ms / request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("alone", "store"):
        runs = [p for p in phases if p.mode == mode]
        if not runs:
            continue

        def med(figure: Callable[[Phase], float], runs: list[Phase] = runs) -> float:
            return statistics.median(figure(r) for r in runs)

        lines.append(
            f"| {mode} | {med(lambda r: r.admitted):,.0f} | {med(lambda r: r.waited):,.0f} |"
            f" {med(lambda r: r.pct(0.5)):.3f} |"
            f" {med(lambda r: r.pct(0.99)):.3f} | {med(lambda r: r.pct(0.999)):.3f} |"
            f" {med(lambda r: max(r.latencies) * 1000):.2f} |"
            f" {med(lambda r: r.pct(0.5, 'durations')):.3f} |"
            f" {med(lambda r: r.pct(0.99, 'durations')):.3f} |"
            f" {med(lambda r: r.idle_per_s):.1f} | {med(lambda r: r.per_s):.1f} |"
            f" {med(lambda r: r.per_request):+.4f} |"
            f" {med(lambda r: r.own_idle / r.seconds):.1f} |"
            f" {med(lambda r: r.own_loaded / r.seconds):.1f} |"
            f" {med(lambda r: r.pct(0.5, 'ticks')):.3f} |"
            f" {med(lambda r: r.pct(0.99, 'ticks')):.3f} |"
            f" {med(lambda r: r.pct(0.5, 'holds')):.3f} |"
            f" {med(lambda r: r.pct(0.99, 'holds')):.3f} |"
            f" {med(lambda r: r.cpu_s / r.admitted * 1000):.3f} |"
        )
    return lines


async def run(args: argparse.Namespace) -> list[Phase]:
    phases: list[Phase] = []
    with RedisServer.start(port=0) as server:
        peers = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--peers", server.url, "--rate", str(args.rate),
            "--hold", str(args.hold), preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            await asyncio.sleep(2.0)
            for round_ in range(args.rounds):
                for mode in ("alone", "store") if round_ % 2 == 0 else ("store", "alone"):
                    result = await phase(mode, server.url, args, round_)
                    phases.append(result)
                    print(
                        f"round {round_} {mode}: p50 {result.pct(0.5):.3f} ms, p99"
                        f" {result.pct(0.99):.3f} ms, max {max(result.latencies) * 1000:.2f}"
                        f" ms, waited {result.waited};"
                        f" tick p99 {result.pct(0.99, 'ticks'):.3f} ms, longest hold p99"
                        f" {result.pct(0.99, 'holds'):.3f} ms;"
                        f" submit p99 {result.pct(0.99, 'durations'):.3f} ms; redis"
                        f" {result.idle_per_s:.1f}/s idle, {result.per_s:.1f}/s loaded,"
                        f" {result.per_request:+.4f} per request; own exchanges"
                        f" {result.own_idle}/{result.own_loaded}",
                        flush=True,
                    )
        finally:
            peers.terminate()
            await asyncio.wait_for(peers.wait(), 10)
    return phases


def write(phases: list[Phase], args: argparse.Namespace, load_avg: tuple[float, float]) -> None:
    body = [
        SECTION,
        "",
        f"Command: `python benchmarks/workers/hot_path.py --rounds {args.rounds} --rate"
        f" {args.rate:g} --seconds {args.seconds:g} --hold {args.hold:g}` ({date.today()},"
        f" {os.cpu_count()} CPUs, Python {platform.python_version()}, redis-server 7; load"
        f" average {load_avg[0]:.2f} before, {load_avg[1]:.2f} after). One admission core"
        f" at {args.rate:g} requests/s (each held {args.hold:g} s), 4 engines sampled every"
        " 50 ms; `store`: its sync task on a real redis-server with 3 peer replicas (another"
        f" process, {args.rate / 4:g} requests/s each) publishing their views. Latency: from"
        " when a request was due to `submit()`'s decision, waiting for the loop included"
        " (the timer's own lateness too: ~1 ms at p50 in both modes). Round trips: the"
        " server's EVALSHA, EVAL and SCRIPT LOAD (the peers' syncs included), idle (no"
        " requests) and loaded, over phases of the same length; per request: their"
        " difference over the requests. Median over"
        f" {args.rounds} rounds, modes alternated.",
        "",
        *table(phases),
        "",
    ]
    text = RESULTS.read_text()
    before, _, rest = text.partition(SECTION)
    nxt = rest.find("\n## ", 1) if rest else -1
    after = rest[nxt + 1 :] if nxt >= 0 else ""
    RESULTS.write_text(before.rstrip("\n") + "\n\n" + "\n".join(body) + (after and "\n" + after))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--peers", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--dry", action="store_true", help="print, do not write results.md")
    args = parser.parse_args()
    if args.peers:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(peers_main(args.peers, args.rate, args.hold))
        return
    load_before = os.getloadavg()[0]
    phases = asyncio.run(run(args))
    print("\n".join(table(phases)))
    if not args.dry:
        write(phases, args, (load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
