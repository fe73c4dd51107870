"""CPU cost of turning one engine metrics page into a NodeSample.

Compares prometheus_client's full text parser with kvgate's targeted scanner on the real
vLLM page (53 KB, 614 lines), and times every dialect's adapter on its fixture page.
CPU time (time.process_time), median of 7 rounds. Run:

    python benchmarks/scrape_cost/bench_parse.py
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvgate.adapters import KINDS, adapter_for

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "tests" / "adapters" / "pages"


def cpu_us(fn: Callable[[], object], iterations: int, rounds: int = 7) -> tuple[float, float]:
    """(best, median) CPU microseconds per call over `rounds` rounds. The best round is
    the cost itself; the median shows how much a busy shared machine added."""
    fn()
    results = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(iterations):
            fn()
        results.append((time.process_time() - start) / iterations * 1e6)
    return min(results), statistics.median(results)


def _row(label: str, cost: tuple[float, float], extra: str = "") -> str:
    return f"| {label} |{extra} {cost[0]:,.0f} µs | {cost[1]:,.0f} µs |"


def prometheus_client_sample(page: bytes) -> dict[str, float]:
    """What a prometheus_client-based vLLM adapter would do: parse all, keep a few."""
    wanted = {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:inter_token_latency_seconds",
        "vllm:num_preemptions",
        "vllm:cache_config_info",
    }
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page.decode()):
        if family.name in wanted:
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def main() -> None:
    vllm = (PAGES / "vllm.txt").read_bytes()
    n_lines = vllm.count(b"\n")
    lines = [
        f"python {sys.version.split()[0]}, {platform.machine()}, "
        f"page {len(vllm)} bytes / {n_lines} lines, load average {os.getloadavg()[0]:.1f}",
        "",
        "| parser (real vLLM page) | CPU per parse, best | median |",
        "| --- | ---: | ---: |",
    ]
    full = cpu_us(lambda: prometheus_client_sample(vllm), 40)
    adapter = adapter_for("vllm")
    targeted = cpu_us(lambda: adapter.parse(vllm, 0.0), 2000)
    lines += [
        _row("prometheus_client text_string_to_metric_families, keep 6 families", full),
        _row("kvgate VllmAdapter.parse (targeted scan + NodeSample)", targeted),
        f"| ratio (best) | {full[0] / targeted[0]:,.0f}x | |",
        "",
        "| dialect (fixture page) | bytes | CPU per parse, best | median |",
        "| --- | ---: | ---: | ---: |",
    ]
    for kind in KINDS:
        page = (PAGES / f"{kind}.txt").read_bytes()
        parse = functools.partial(adapter_for(kind, capacity_tokens=8192).parse, page, 0.0)
        lines.append(_row(kind, cpu_us(parse, 2000), f" {len(page):,} |"))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
