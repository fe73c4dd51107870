"""Instructions per request and per streamed chunk, counted by callgrind: an A/B that noise
cannot move.

CPU time on this shared 2-core machine moves by 20-30 % between identical runs, far more
than one optimisation of the relay is worth. Valgrind's callgrind counts the instructions
the gateway process executes in user space (the kernel's share is the same syscalls on
both sides of an A/B), and the count of the same code repeats within ~0.5 %.

    python benchmarks/proxy_overhead/instructions.py kvgate floor
    python benchmarks/proxy_overhead/instructions.py before=../old-checkout/src kvgate

Each argument is a stack: `kvgate` (this checkout's `kvgate serve`, native client, policy
`none`, access log on), `floor` (`floor_app.py`: uvicorn and kvgate's upstream client with
none of its logic), or `NAME=SRC`, `kvgate serve` imported from another source tree `SRC`
(a `git worktree` of an older commit). The gateway runs under callgrind (~50x slower) in
front of `bench.py`'s fake engine; counting is switched on only around the measured phase.

The scraper polls on wall time, and under callgrind a request takes ~50x longer, so each
request would carry ~50x its real share of scraping: the gateway scrapes once a second here
(the longest period the config allows) instead of every 50 ms. An idle phase first
measures the instructions per second spent with no traffic, and the "less idle work"
columns subtract that rate times each phase's wall time: what remains is the work of the
requests and chunks themselves. (A chunk figure includes its stream's per-request work,
spread over its 50 events, or its 500 in the fast phase, whose events come back to back
so that one read carries several.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (the fake engine, the clients and the port helpers)


def _command(stack: str, port: int, engine_port: int) -> tuple[list[str], dict[str, str]]:
    env = bench.stack_env(engine_port)
    env.update(
        # The slowest scrape the config allows: under callgrind a 50 ms period would make
        # the scraper's share larger than the requests' and its subtraction the noise.
        KVGATE_SCRAPE__INTERVAL_S="1.0",
        PYTHONMALLOC="malloc",  # valgrind follows malloc; pymalloc's arenas confuse it
    )
    if stack == "floor":
        return bench.floor_command(port, engine_port, env), env
    _, _, src = stack.partition("=")
    if src:
        env["PYTHONPATH"] = src
    return bench.none_command(port, src, env), env


def _total(dump: str) -> int:
    with open(dump) as lines:
        for line in lines:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


def _counted(pid: int, out: str, phase: str, run: Coroutine[Any, Any, T]) -> tuple[int, float, T]:
    """Instructions executed by `pid` while `run` runs, the wall time, what `run` returned."""
    subprocess.run(["callgrind_control", "--zero", str(pid)], capture_output=True, check=True)
    start = time.monotonic()
    result = asyncio.run(run)
    wall = time.monotonic() - start
    subprocess.run(["callgrind_control", "--dump", phase, str(pid)], capture_output=True)
    time.sleep(1.0)  # the dump is written asynchronously
    dumps = sorted(glob.glob(out + ".*"), key=os.path.getmtime)
    return _total(dumps[-1]), wall, result


def measure(stack: str, engine_port: int, args: argparse.Namespace, workdir: Path) -> str:
    port = bench.free_port()
    command, env = _command(stack, port, engine_port)
    out = str(workdir / f"callgrind-{stack.partition('=')[0]}.out")
    process = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        bench.wait_port(port, within=300)
        time.sleep(3)  # the scraper and the model catalog warm up
        asyncio.run(bench.nonstream_phase(port, 300))
        idle, idle_s, _ = _counted(process.pid, out, "idle", asyncio.sleep(args.duration))
        per_s = idle / idle_s  # the scraper's share, and whatever else runs without traffic
        requests = bench.nonstream_phase(port, args.requests)
        total, wall, _ = _counted(process.pid, out, "requests", requests)
        line = (
            f"| {stack.partition('=')[0]} | {total / args.requests / 1e3:,.1f}k |"
            f" {(total - per_s * wall) / args.requests / 1e3:,.1f}k |"
        )
        if args.streams:
            run = bench.stream_phase(port, args.streams, 50, args.duration, 1.0)
            total, wall, streamed = _counted(process.pid, out, "streams", run)
            line += f" {(total - per_s * wall) / streamed.chunks / 1e3:,.1f}k |"
            # Events back to back: a proxy's reads carry several events each.
            run = bench.stream_phase(port, args.streams, 500, args.duration, 1.0, token_ms=0.05)
            total, wall, fast = _counted(process.pid, out, "fast", run)
            line += (
                f" {(total - per_s * wall) / fast.chunks / 1e3:,.2f}k |"
                f" {streamed.chunks:,} / {fast.chunks:,} | {per_s / 1e6:,.1f}M |"
            )
        return line
    finally:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(60)
        if process.poll() is None:
            process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stacks", nargs="+", help="kvgate, floor or NAME=SRC")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--streams", type=int, default=5, help="few, so that every event is its own read (0: none)"
    )
    parser.add_argument("--duration", type=float, default=6.0)
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 1
    engine_port = bench.free_port()
    engine = subprocess.Popen(
        [sys.executable, str(HERE / "bench.py"), "engine", "--port", str(engine_port)]
    )
    print(
        "| stack | instructions / request | the same less idle work | instructions / chunk,"
        " less idle work | the same, fast streams | chunks (paced / fast) | idle instructions / s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        bench.wait_port(engine_port)
        with tempfile.TemporaryDirectory(prefix="kvgate-callgrind-") as tmp:
            for stack in args.stacks:
                print(measure(stack, engine_port, args, Path(tmp)), flush=True)
    finally:
        engine.terminate()
        engine.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
