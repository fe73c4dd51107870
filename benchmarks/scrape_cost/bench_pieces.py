"""Where the CPU of one scrape goes: each piece alone, sequentially, on one connection.

aiohttp GET+read, the same GET with plain asyncio streams, the lean client kvgate uses,
the vLLM parse, and the adaptive policy's observe. Best and median of 5 rounds.
Run: python benchmarks/scrape_cost/bench_pieces.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
from bench_scrape import _start_server

from kvgate.adapters import adapter_for
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies import build_policy
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway.engines.scrape_http import LeanHttpFetcher


async def _cpu_async(fn: Callable[[], Awaitable[object]], n: int = 300) -> tuple[float, float]:
    await fn()
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(n):
            await fn()
        rounds.append((time.process_time() - start) / n * 1e6)
    return min(rounds), statistics.median(rounds)


def _cpu(fn: Callable[[], object], n: int = 1000) -> tuple[float, float]:
    fn()
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(n):
            fn()
        rounds.append((time.process_time() - start) / n * 1e6)
    return min(rounds), statistics.median(rounds)


async def main(port: int) -> list[tuple[str, tuple[float, float]]]:
    url = f"http://127.0.0.1:{port}/metrics"
    rows = []
    async with aiohttp.ClientSession() as session:

        async def with_aiohttp() -> bytes:
            async with session.get(url) as resp:
                return await resp.read()

        rows.append(("aiohttp GET + read", await _cpu_async(with_aiohttp)))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"

        async def with_streams() -> bytes:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            size = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            return await reader.readexactly(size)

        rows.append(("bare asyncio streams GET", await _cpu_async(with_streams)))
        writer.close()
        lean = LeanHttpFetcher()
        rows.append(("kvgate LeanHttpFetcher.get", await _cpu_async(lambda: lean.get(url, {}))))
        await lean.close()
        page = await with_aiohttp()
    adapter = adapter_for("vllm")
    rows.append(("VllmAdapter.parse", _cpu(lambda: adapter.parse(page, 0.0))))
    clock = MonotonicClock()
    policy = build_policy(AdmissionSettings(), clock)
    sample = adapter.parse(page, clock.now())
    rows.append(("adaptive policy.observe", _cpu(lambda: policy.observe("n", sample))))
    return rows


if __name__ == "__main__":
    proc, port = _start_server()
    try:
        result = asyncio.run(main(port))
    finally:
        proc.terminate()
        proc.wait(timeout=5)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print()
    print("| piece | CPU, best | median |")
    print("| --- | ---: | ---: |")
    for name, (best, median) in result:
        print(f"| {name} | {best:,.0f} µs | {median:,.0f} µs |")
