"""Client-side CPU per upstream request: aiohttp's ClientSession vs kvgate's H1Pool.

Same fake engine as `bench.py` (its own process), 16 keep-alive connections, small
non-streaming completions; the figure is this process's CPU time per request, i.e. what
the gateway pays for the upstream half of every relayed request.

    python benchmarks/proxy_overhead/client_cost.py [--requests 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

from kvgate.gateway.http.h1client import H1Pool

BODY = json.dumps({"model": bench.MODEL, "prompt": "hello world", "max_tokens": 4}).encode()
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"0123456789abcdef")]


async def with_aiohttp(url: str, requests: int) -> None:
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=2, sock_read=None)
    async with aiohttp.ClientSession(auto_decompress=False, timeout=timeout) as session:
        left = requests
        headers = [(k.decode(), v.decode()) for k, v in HEADERS]

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url + "/v1/completions", data=BODY, headers=headers) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(16)))


async def with_h1pool(url: str, requests: int) -> None:
    pool = H1Pool(connect_timeout_s=2)
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            response = await pool.request(url, "POST", "/v1/completions", HEADERS, BODY)
            await response.read()
            response.release()

    await asyncio.gather(*(worker() for _ in range(16)))
    pool.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = bench.free_port()
    engine = subprocess.Popen([sys.executable, bench.__file__, "engine", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {"aiohttp": [], "kvgate H1Pool": []}
    try:
        bench.wait_port(port)
        for _ in range(args.rounds):
            for name, fn in (("aiohttp", with_aiohttp), ("kvgate H1Pool", with_h1pool)):
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    runner.run(fn(url, 300))  # warm-up
                    start = time.process_time()
                    runner.run(fn(url, args.requests))
                    results[name].append((time.process_time() - start) / args.requests * 1e6)
    finally:
        engine.terminate()
        engine.wait(10)
    print("| upstream client | CPU µs / request (median) | rounds |")
    print("| --- | ---: | --- |")
    for name, values in results.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {statistics.median(values):.0f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
