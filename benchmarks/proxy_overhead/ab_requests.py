"""CPU per non-streaming request, two kvgate versions side by side: a paired A/B.

`bench.py run` measures each stack in its own time slot, so a 5-10 % change drowns in the
machine's drift (the same code measured 0.30-0.36 ms in consecutive rounds). Here both
gateways run at once in front of one fake engine, and each round measures a burst through
A, then one through B (the order alternates). Each round gives a ratio B/A of two
measurements taken seconds apart; the median ratio over many rounds is the figure to quote.

    python benchmarks/proxy_overhead/ab_requests.py A_SRC B_SRC --rounds 20

`A_SRC` and `B_SRC` are `src` directories (this checkout's and a `git worktree` of another
commit's). Each gateway is `kvgate serve` with the native upstream client, policy `none`
and its access log on, as in `bench.py`. The idle gateway's scraper runs during the other's
burst: the same cost for both, counted in neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (the fake engine, the client, the CPU counter)


@contextlib.contextmanager
def gateway(src: str, engine_port: int) -> Iterator[tuple[int, int]]:
    """`kvgate serve` imported from `src`; yields (port, pid)."""
    port = bench.free_port()
    env = bench.stack_env(engine_port)
    env["PYTHONPATH"] = src
    command = bench.none_command(port, src, env)
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        bench.wait_port(port)
        yield port, process.pid
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def burst(port: int, pid: int, requests: int) -> tuple[float, float]:
    """(CPU ms per request, requests per second) of one burst through the gateway `pid`."""
    before = bench.cpu_seconds(pid)
    wall = asyncio.run(bench.nonstream_phase(port, requests))
    return (bench.cpu_seconds(pid) - before) / requests * 1e3, requests / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a_src")
    parser.add_argument("b_src")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    engine_port = bench.free_port()
    engine = subprocess.Popen(
        [sys.executable, str(HERE / "bench.py"), "engine", "--port", str(engine_port)]
    )
    try:
        bench.wait_port(engine_port)
        with gateway(args.a_src, engine_port) as a, gateway(args.b_src, engine_port) as b:
            for port, pid in (a, b):  # warm up: imports, the model catalog, the JIT-less caches
                burst(port, pid, 1000)
            rows = []
            for round_no in range(args.rounds):
                order = (a, b) if round_no % 2 == 0 else (b, a)
                results = {side: burst(*side, args.requests) for side in order}
                rows.append((results[a], results[b]))
                print(
                    f"round {round_no + 1}: A {results[a][0]:.3f} ms, B {results[b][0]:.3f} ms,"
                    f" B/A {results[b][0] / results[a][0]:.3f}",
                    flush=True,
                )
                time.sleep(0.2)
    finally:
        engine.terminate()
        engine.wait(10)
    ratios = [rb[0] / ra[0] for ra, rb in rows]
    a_cpu = [ra[0] for ra, _ in rows]
    b_cpu = [rb[0] for _, rb in rows]
    print(f"\nA: {args.a_src}\nB: {args.b_src}\n")
    print("| | CPU ms / request, median (range) | req/s, median |")
    print("| --- | ---: | ---: |")
    for name, cpu, side in (("A", a_cpu, 0), ("B", b_cpu, 1)):
        rps = statistics.median(r[side][1] for r in rows)
        spread = f"{min(cpu):.3f}-{max(cpu):.3f}"
        print(f"| {name} | {statistics.median(cpu):.3f} ({spread}) | {rps:,.0f} |")
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"\nB/A per round: median {statistics.median(ratios):.3f},"
        f" quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, {args.rounds} rounds"
        f" of {args.requests} requests"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
