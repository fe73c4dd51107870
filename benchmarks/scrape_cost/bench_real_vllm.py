"""The lean client and aiohttp against a real vLLM engine's /metrics, interleaved.

Polls alternate between the two clients every 50 ms (so both see the same machine load)
with a 40 ms timeout (the scraper's timeout until polls were sized to the engine) and the
real vLLM parse; prints how many polls
each lost to the timeout and their latency. Also checks the adapter's abort on a server
started without --enable-scale-out (expect False, remembered).
Start an engine first (`bash scripts/real-vllm/serve.sh PORT`), then:
    python benchmarks/scrape_cost/bench_real_vllm.py PORT [POLLS]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiohttp
from aiohttp_fetcher import AiohttpFetcher

from kvgate.adapters import adapter_for
from kvgate.gateway.engines.scrape_http import LeanHttpFetcher, MetricsFetcher


async def main(port: int, polls: int) -> None:
    base = f"http://127.0.0.1:{port}"
    adapter = adapter_for("vllm")
    async with aiohttp.ClientSession() as session:
        aborted = await adapter.abort(session, base, "nope", endpoint="chat")
        print(
            f"abort without --enable-scale-out -> {aborted}, remembered unsupported: "
            f"{not getattr(adapter, 'abort_supported', True)}"
        )
        fetchers: dict[str, MetricsFetcher] = {
            "lean": LeanHttpFetcher(),
            "aiohttp": AiohttpFetcher(session),
        }
        results: dict[str, list[float | None]] = {name: [] for name in fetchers}
        for i in range(polls * 2):
            name = "lean" if i % 2 == 0 else "aiohttp"
            start = time.perf_counter()
            try:
                async with asyncio.timeout(0.04):
                    page = await fetchers[name].get(base + "/metrics", {})
                adapter.parse(page, time.monotonic())
                results[name].append(time.perf_counter() - start)
            except TimeoutError:
                results[name].append(None)
            await asyncio.sleep(0.05)
        await fetchers["lean"].close()
    print(f"load average {os.getloadavg()[0]:.1f}; {polls} polls each, interleaved")
    print()
    print("| HTTP client | timed out at 40 ms | p50 of the rest | p90 of the rest |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in results.items():
        done = sorted(v for v in values if v is not None)
        lost = len(values) - len(done)
        p50 = done[len(done) // 2] * 1e3 if done else float("nan")
        p90 = done[int(len(done) * 0.9)] * 1e3 if done else float("nan")
        print(f"| {name} | {lost}/{len(values)} | {p50:.1f} ms | {p90:.1f} ms |")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 200))
