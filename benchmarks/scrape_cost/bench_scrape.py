"""How many engines one kvgate process can watch: CPU per scrape of the real vLLM page
through the whole path (aiohttp GET on a keep-alive connection, targeted parse, the real
adaptive policy's observe), and whether N nodes at 50 ms keep their schedule.

The engines are one subprocess (page_server.py) answering every GET with the real 53 KB
vLLM page, so the scraper process's own CPU (time.process_time) is what is measured.
Run:  python benchmarks/scrape_cost/bench_scrape.py [N ...] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, urlsplit

import aiohttp
from aiohttp_fetcher import AiohttpFetcher

from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings, ScrapeSettings
from kvgate.adapters.vllm import VllmAdapter
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies import build_policy
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway.engines.scrape_http import LeanHttpFetcher, MetricsFetcher
from kvgate.gateway.engines.scraper import Scraper
from kvgate.sim.metrics import only_samples

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "tests" / "adapters" / "pages" / "vllm.txt"
INTERVAL = 0.05


def _page_file(page: Literal["full", "narrowed"]) -> Path:
    """The real vLLM page, or the part of it the scraper asks vLLM for (the narrowed page)."""
    if page == "full":
        return PAGE
    url = VllmAdapter().narrowed_metrics_url("http://engine/metrics")
    assert url is not None
    names = frozenset(parse_qs(urlsplit(url).query)["name[]"])
    path = Path(tempfile.mkdtemp(prefix="kvgate-bench-")) / "narrowed.txt"
    path.write_text(only_samples(PAGE.read_text(), names))
    return path


def _start_server(page: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = Path(tempfile.mkdtemp(prefix="kvgate-bench-")) / "port"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "page_server.py"), str(page), str(port_file)]
    )
    deadline = time.monotonic() + 10
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("page server did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def _server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fetcher(http: Literal["lean", "aiohttp"], session: aiohttp.ClientSession) -> MetricsFetcher:
    return LeanHttpFetcher() if http == "lean" else AiohttpFetcher(session)


async def run(
    n: int, port: int, seconds: float, server_pid: int, http: Literal["lean", "aiohttp"]
) -> dict[str, float | str]:
    clock = MonotonicClock()
    policy = build_policy(AdmissionSettings(), clock)
    backends = [
        Backend.from_settings(
            BackendSettings(
                url=f"http://127.0.0.1:{port}",
                name=f"node-{i}",
                metrics_url=f"http://127.0.0.1:{port}/metrics?node={i}",
            )
        )
        for i in range(n)
    ]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        settings = ScrapeSettings(interval_s=INTERVAL)
        scraper = Scraper(backends, settings, policy, _fetcher(http, session), clock)
        async with scraper:
            await asyncio.sleep(1.0)  # warm-up: connections opened, caches filled
            before = {k: (s.scrapes_total, s.failures_total) for k, s in scraper.stats().items()}
            for s in scraper.stats().values():
                s.drain_latencies()
            cpu0, srv0, wall0 = time.process_time(), _server_cpu(server_pid), time.perf_counter()
            await asyncio.sleep(seconds)
            cpu1, srv1, wall1 = time.process_time(), _server_cpu(server_pid), time.perf_counter()
            stats = scraper.stats()
            scrapes = sum(s.scrapes_total - before[k][0] for k, s in stats.items())
            failures = sum(s.failures_total - before[k][1] for k, s in stats.items())
            latencies = [x for s in stats.values() for x in s.drain_latencies()]
        await scraper.fetcher.close()
    wall = wall1 - wall0
    target = n * wall / INTERVAL
    return {
        "http": http,
        "nodes": n,
        "scrapes_per_s": scrapes / wall,
        "kept_schedule": scrapes / target,
        "failures": failures,
        "cpu_cores": (cpu1 - cpu0) / wall,
        "cpu_us_per_scrape": (cpu1 - cpu0) / max(scrapes, 1) * 1e6,
        "server_cores": (srv1 - srv0) / wall,
        "latency_p50_ms": statistics.median(latencies) * 1e3 if latencies else float("nan"),
        "latency_p99_ms": (
            statistics.quantiles(latencies, n=100)[98] * 1e3
            if len(latencies) > 100
            else float("nan")
        ),
    }


async def sequential(
    port: int, count: int, http: Literal["lean", "aiohttp"]
) -> tuple[float, float]:
    """CPU per scrape with no concurrency: one node, `count` back-to-back polls through
    `Scraper.scrape_once` on one keep-alive connection. Best and median of 5 rounds."""
    clock = MonotonicClock()
    policy = build_policy(AdmissionSettings(), clock)
    backend = Backend.from_settings(BackendSettings(url=f"http://127.0.0.1:{port}", name="seq"))
    async with aiohttp.ClientSession() as session:
        settings = ScrapeSettings(interval_s=1.0)
        scraper = Scraper([backend], settings, policy, _fetcher(http, session), clock)
        rounds = []
        for _ in range(6):
            start = time.process_time()
            for _ in range(count):
                await scraper.scrape_once(backend)
            rounds.append((time.process_time() - start) / count * 1e6)
        failures = scraper.stats()["seq"].failures_total
        await scraper.fetcher.close()
    if failures:
        raise RuntimeError(f"{failures} sequential scrapes failed")
    rounds = rounds[1:]  # the first round warms up
    return min(rounds), statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("nodes", nargs="*", type=int, default=[10, 50, 100, 200])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--uvloop", action="store_true", help="run the scraper on uvloop")
    parser.add_argument(
        "--page",
        choices=("full", "narrowed"),
        default="full",
        help="serve the real 53 KB page, or the ~2 KB part of it kvgate asks vLLM for",
    )
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    logging.getLogger("kvgate.gateway.engines.scraper").setLevel(logging.ERROR)  # 1 line per node
    page = _page_file(args.page)
    proc, port = _start_server(page)
    try:
        clients: tuple[Literal["lean", "aiohttp"], ...] = ("lean", "aiohttp")
        seq = {http: asyncio.run(sequential(port, 300, http)) for http in clients}
        rows = [
            asyncio.run(run(n, port, args.seconds, proc.pid, http))
            for http in clients
            for n in args.nodes
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=5)
    loop = "uvloop" if args.uvloop else "asyncio"
    print(
        f"page {args.page} ({page.stat().st_size:,} bytes), "
        f"loop {loop}, interval {INTERVAL * 1000:.0f} ms, {args.seconds:.0f} s per run, "
        f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs"
    )
    print()
    print("Sequential: one node polled back to back; whole path = GET + parse + policy.observe.")
    print()
    print("| HTTP client | CPU per scrape, best | median | nodes per core at 50 ms |")
    print("| --- | ---: | ---: | ---: |")
    for http, (best, median) in seq.items():
        print(f"| {http} | {best:,.0f} µs | {median:,.0f} µs | {1e6 / (best * 20):,.0f} |")
    print()
    print(
        "| HTTP client | nodes | scrapes/s | of schedule | failures | scraper CPU (cores) "
        "| CPU/scrape | page server CPU (cores) | latency p50 | p99 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['http']} | {r['nodes']} | {r['scrapes_per_s']:,.0f} | {r['kept_schedule']:.0%} "
            f"| {r['failures']:.0f} | {r['cpu_cores']:.2f} | {r['cpu_us_per_scrape']:,.0f} µs "
            f"| {r['server_cores']:.2f} | {r['latency_p50_ms']:.1f} ms "
            f"| {r['latency_p99_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
