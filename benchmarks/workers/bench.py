"""`kvgate serve --workers N`: throughput and CPU per request with 1 and 2 workers, and
what the shared store costs.

Stacks, interleaved round by round (so load from elsewhere falls on all of them alike):

- `1 process`: `kvgate serve` alone, no store (kvgate as it runs without replicas);
- `1 process + store`: the same with `--store` on a redis-server of this benchmark's (the
  sync task runs, admission reads the peers' views; no request waits for the store);
- `2 workers`: `kvgate serve --workers 2` (SO_REUSEPORT, a private redis-server);
- `2 processes, no store`: the control: two independent `kvgate serve` on two ports, the
  client's connections split between them; what two gateway processes do on this machine
  with nothing shared;
- `2 processes + store`: the same two processes sharing a store (the store's part of
  `2 workers`, without SO_REUSEPORT);
- `2 processes + store on one port`: two `kvgate serve` started by hand as workers are
  (SO_REUSEPORT on one port, one store), without the supervisor.

Each stack sits in front of the fast fake engine of `benchmarks/proxy_overhead` (instant
non-streaming answers, in its own process) with the default policy (`adaptive`) and the
default access log. The load is closed-loop: `--clients` client processes, each with
`--connections` keep-alive connections, send `--requests` small non-streaming completions
in all after a warm-up. Measured per phase:

- throughput (requests / wall time), and the answers other than 200 (a gateway that finds
  its engine's samples stale refuses with 503: the engine shares the cores too);
- CPU per request of every party, from `/proc/<pid>/task/*/schedstat`: the gateway (all
  its processes: workers, supervisor), its redis-server, the engine, the clients;
- the cores in use (the parties' CPU over wall time; the machine has 2);
- store round trips per second (redis `INFO commandstats`: EVALSHA, EVAL, SCRIPT LOAD):
  the sync ticks, 20 per second per process whatever the traffic; no request waits for one;
- what else ran: the machine's busy cores beyond our parties (`/proc/stat`), and the
  hypervisor's steal time (CPU time the VM's cores were runnable but not running).

    .venv/bin/python benchmarks/workers/bench.py [--rounds 3] [--requests 6000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROXY_BENCH = HERE.parent / "proxy_overhead" / "bench.py"
sys.path.insert(0, str(PROXY_BENCH.parent))
import bench as proxy  # noqa: E402  (the fake engine, the client and the CPU reader)

from kvgate.procs.redis_server import RedisServer  # noqa: E402

STACKS = (
    "1 process",
    "1 process + store",
    "2 workers",
    "2 processes, no store",
    "2 processes + store",
    "2 processes + store on one port",
)


@dataclass
class Phase:
    stack: str
    requests: int
    wall_s: float
    gateway_cpu_s: float
    redis_cpu_s: float
    engine_cpu_s: float
    client_cpu_s: float
    store_commands: int
    machine_busy_s: float
    steal_s: float
    refused: int

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    def per_request_ms(self, cpu_s: float) -> float:
        return cpu_s / self.requests * 1000

    @property
    def ours_s(self) -> float:
        return self.gateway_cpu_s + self.redis_cpu_s + self.engine_cpu_s + self.client_cpu_s

    @property
    def cores(self) -> float:
        return self.ours_s / self.wall_s

    @property
    def others_cores(self) -> float:
        return max(0.0, self.machine_busy_s - self.ours_s) / self.wall_s


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cpu(pids: list[int]) -> float:
    """CPU seconds of exactly these processes (all their threads; not their children)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{pid}/task/{task}/schedstat").read_text()
                    total += int(stat.split()[0])
    return total / 1e9


def _machine() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


_ROUND_TRIPS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script|load")


def _commands(url: str | None) -> int:
    """The round trips the store has served so far (0 without a store): the commands
    clients send, not those the scripts run."""
    if url is None:
        return 0
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats[name]["calls"]) for name in _ROUND_TRIPS if name in stats)


@contextlib.contextmanager
def start_stack(
    stack: str, engine_port: int, workdir: Path
) -> Iterator[tuple[list[int], list[int], str | None, list[int]]]:
    """Yields (ports, gateway root pids, store URL or None, redis pids of this benchmark's)."""
    env = proxy.stack_env(engine_port)
    redis: RedisServer | None = None
    extra: list[str] = []
    if stack.endswith("+ store") or stack.endswith("one port"):
        redis = RedisServer.start(port=None)
        extra = ["--store", redis.url]
    if stack.endswith("one port"):
        extra += ["--as-worker", "2"]
    elif stack == "2 workers":
        extra = ["--workers", "2"]
    count = 2 if stack.startswith("2 processes") else 1
    ports = [proxy.free_port() for _ in range(count)]
    if stack.endswith("one port"):
        ports = [ports[0]] * count
    logs = [open(workdir / f"gateway-{i}.log", "wb") for i in range(count)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "kvgate", "serve", "--port", str(port), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for port, log in zip(ports, logs, strict=True)
    ]
    try:
        for port in set(ports):
            proxy.wait_port(port)
        time.sleep(2.0)  # workers up, scraper and sync warmed up
        url = redis.url if redis is not None else _private_store(ports[0])
        outside = [redis.process.pid] if redis is not None else []
        yield ports, [p.pid for p in processes], url, outside
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
        if redis is not None:
            redis.stop()


def _private_store(port: int) -> str | None:
    """The store a `--workers` gateway started for itself (from /admin/state)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/state", timeout=5) as r:
        cluster = json.loads(r.read())["cluster"]
    return None if cluster is None else str(cluster["store"])


async def client_main(ports: list[int], requests: int, connections: int) -> None:
    """The requests and connections split evenly over `ports`; prints the count of
    answers other than 200 (a refusal is an answer: counted, not a reason to stop)."""
    n = len(ports)
    refused: Counter[int] = Counter()
    await asyncio.gather(
        *(proxy.nonstream_phase(p, requests // n, refused, connections // n) for p in ports)
    )
    print(json.dumps({str(status): count for status, count in refused.items()}), flush=True)


def run_clients(
    ports: list[int], requests: int, clients: int, connections: int
) -> tuple[float, int]:
    """`clients` client processes sharing `requests`: (the wall time until all are done,
    answers other than 200). Their CPU shows in this process's children times once they
    have exited."""
    share = requests // clients
    command = [sys.executable, __file__, "client", "--ports", ",".join(map(str, ports)),
               "--requests", str(share), "--connections", str(connections)]  # fmt: skip
    started = time.perf_counter()
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE) for _ in range(clients)]
    refused = 0
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError("a client failed")
        refused += sum(n for status, n in json.loads(out).items() if status != "200")
    return time.perf_counter() - started, refused


def measure(
    stack: str, engine_pid: int, engine_port: int, args: argparse.Namespace, workdir: Path
) -> Phase:
    with start_stack(stack, engine_port, workdir) as (ports, roots, store_url, outside):
        run_clients(ports, 500, 1, args.connections)  # warm-up
        tree = [p for root in roots for p in proxy._tree(root)]
        redis_pids = outside or [p for p in tree if _comm(p) == "redis-server"]
        gw_pids = [p for p in tree if p not in redis_pids]

        def reading() -> tuple[float, float, float, int, tuple[float, float]]:
            return (
                _cpu(gw_pids),
                _cpu(redis_pids),
                proxy.cpu_seconds(engine_pid),
                _commands(store_url),
                _machine(),
            )

        before = reading()
        children_before = os.times()
        wall, refused = run_clients(ports, args.requests, args.clients, args.connections)
        children_after = os.times()
        after = reading()
    client_cpu = (children_after.children_user + children_after.children_system) - (
        children_before.children_user + children_before.children_system
    )
    return Phase(
        stack=stack,
        requests=args.requests // args.clients * args.clients,
        wall_s=wall,
        gateway_cpu_s=after[0] - before[0],
        redis_cpu_s=after[1] - before[1],
        engine_cpu_s=after[2] - before[2],
        client_cpu_s=client_cpu,
        store_commands=after[3] - before[3],
        machine_busy_s=after[4][0] - before[4][0],
        steal_s=after[4][1] - before[4][1],
        refused=refused,
    )


def render(phases: dict[str, list[Phase]], args: argparse.Namespace, load: str) -> str:
    lines = [
        f"{args.requests} non-streaming requests per phase from {args.clients} client process(es)"
        f" x {args.connections} keep-alive connections; policy adaptive, access log on;"
        f" {os.cpu_count()} CPUs, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')};"
        f" median of {args.rounds} interleaved rounds (per column); {load}.",
        "",
        "| stack | req/s | gateway CPU ms / req | redis CPU ms / req | engine CPU ms / req"
        " | client CPU ms / req | cores busy (ours) | others' cores | steal"
        " | store round trips / s | not 200 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for stack, runs in phases.items():
        lines.append(_row(stack, runs))
    return "\n".join(lines) + "\n"


def _row(stack: str, runs: list[Phase]) -> str:
    def med(figure: Callable[[Phase], float]) -> float:
        return statistics.median(figure(p) for p in runs)

    return (
        f"| {stack} | {med(lambda p: p.rps):,.0f}"
        f" | {med(lambda p: p.per_request_ms(p.gateway_cpu_s)):.3f}"
        f" | {med(lambda p: p.per_request_ms(p.redis_cpu_s)):.4f}"
        f" | {med(lambda p: p.per_request_ms(p.engine_cpu_s)):.3f}"
        f" | {med(lambda p: p.per_request_ms(p.client_cpu_s)):.3f}"
        f" | {med(lambda p: p.cores):.2f}"
        f" | {med(lambda p: p.others_cores):.2f}"
        f" | {med(lambda p: p.steal_s / p.wall_s / (os.cpu_count() or 1)):.0%}"
        f" | {med(lambda p: p.store_commands / p.wall_s):.1f}"
        f" | {sum(p.refused for p in runs)} |"
    )


def run(args: argparse.Namespace) -> int:
    engine_port = proxy.free_port()
    engine = subprocess.Popen(
        [sys.executable, str(PROXY_BENCH), "engine", "--port", str(engine_port)]
    )
    stacks = [s for s in STACKS if not args.only or s in args.only.split(",")]
    phases: dict[str, list[Phase]] = {s: [] for s in stacks}
    load_before = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    try:
        proxy.wait_port(engine_port)
        with tempfile.TemporaryDirectory(prefix="kvgate-workers-") as tmp:
            for round_no in range(args.rounds):
                for stack in stacks:
                    workdir = Path(tmp) / f"{round_no}-{stack.replace(' ', '_')}"
                    workdir.mkdir()
                    phase = measure(stack, engine.pid, engine_port, args, workdir)
                    phases[stack].append(phase)
                    print(f"round {round_no + 1} {stack}: {phase.rps:,.0f} req/s,"
                          f" {phase.cores:.2f} cores", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        engine.terminate()
        engine.wait(10)
    load_after = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    report = render(phases, args, f"load average {load_before} before, {load_after} after")
    print(report)
    if args.out:
        args.out.write_text(report, encoding="utf-8")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("client", help="one client process (used by `run`)")
    client.add_argument("--ports", required=True, help="comma-separated")
    client.add_argument("--requests", type=int, required=True)
    client.add_argument("--connections", type=int, default=16)
    bench = sub.add_parser("run", help="measure every stack and print a Markdown table")
    bench.add_argument("--requests", type=int, default=6000)
    bench.add_argument("--clients", type=int, default=1)
    bench.add_argument("--connections", type=int, default=32, help="per client process")
    bench.add_argument("--rounds", type=int, default=3)
    bench.add_argument("--out", type=Path, help="also write the table to this file")
    bench.add_argument("--only", help="comma-separated stacks")
    args = parser.parse_args()
    import uvloop

    if args.command == "client":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            ports = [int(p) for p in args.ports.split(",")]
            runner.run(client_main(ports, args.requests, args.connections))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
