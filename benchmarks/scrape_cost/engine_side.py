"""What kvgate's scraping costs the engine: the real vLLM API server's CPU, full page vs
narrowed page, side by side.

vLLM renders `/metrics` in its API server, the process that also takes requests and
streams tokens. This starts the real CPU engine (`scripts/real-vllm/serve.sh`, installed by
`scripts/install-real-vllm.sh`), then measures, in alternating phases of `--seconds` each,
the API server's CPU time (`/proc/<pid>/stat`, user + system) while idle and while one
`kvgate serve` scrapes it every 50 ms (the default) on the full page (a `metrics_url` with
a query, which kvgate never narrows and vLLM's `/metrics` route ignores) and on the
narrowed one (what kvgate chooses by itself). It also
times single GETs of both pages, and reads kvgate's own scrape latency from
`/admin/state`. Run from the repository root:

    python benchmarks/scrape_cost/engine_side.py [--seconds 20] [--rounds 2]

Results: results.md, section "What scraping costs the engine".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from real_engine import engine as eng  # noqa: E402  (starting and stopping the real engine)

from kvgate.adapters.vllm import VllmAdapter  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (not its children: the engine core is one)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get_ms(url: str, n: int = 40) -> tuple[float, int]:
    """Median GET time in ms and the page size."""
    times, size = [], 0
    for _ in range(n):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=5) as response:
            size = len(response.read())
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), size


def start_gateway(engine_url: str, narrow: bool, log: Path) -> eng.ServerProcess:
    port = eng.free_port()
    metrics_url = engine_url + ("/metrics" if narrow else "/metrics?page=full")
    config = log.with_suffix(".yaml")
    config.write_text(json.dumps({"backends": [{"url": engine_url, "metrics_url": metrics_url}]}))
    argv = [
        sys.executable, "-m", "kvgate", "serve", "--config", str(config),
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    gateway = eng.spawn("kvgate", argv, port, log, {})
    eng.wait_ready(gateway, "/readyz", 30)
    return gateway


def scrape_view(gateway_url: str) -> tuple[str, float | None]:
    """Which page kvgate polls, and how long its last scrape took."""
    with urllib.request.urlopen(gateway_url + "/admin/state", timeout=5) as response:
        state = json.loads(response.read())
    (node,) = state["scraper"]["nodes"].values()
    return node["page"], node["last_latency_s"]


def phase(pid: int, seconds: float, gateway_url: str | None) -> tuple[float, list[float]]:
    """The API server's CPU share over `seconds`, and kvgate's scrape latencies meanwhile."""
    latencies: list[float] = []
    c0, t0 = cpu_seconds(pid), time.monotonic()
    while time.monotonic() - t0 < seconds:
        time.sleep(0.5)
        if gateway_url is not None:
            _, latency = scrape_view(gateway_url)
            if latency is not None:
                latencies.append(latency * 1000)
    share = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    return share, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-engine-side-"))
    engine = eng.start_engine(tmp / "engine.log", 360)
    assert engine.proc is not None
    pid = engine.proc.pid  # serve.sh execs the API server
    rows: dict[str, list[float]] = {}
    latencies: dict[str, list[float]] = {}
    try:
        narrowed_url = VllmAdapter().narrowed_metrics_url(engine.url + "/metrics")
        assert narrowed_url is not None
        full_ms, full_size = get_ms(engine.url + "/metrics")
        narrow_ms, narrow_size = get_ms(narrowed_url)
        time.sleep(2)
        for _ in range(args.rounds):
            for label, narrow in (("idle", None), ("full page", False), ("narrowed page", True)):
                gateway = None
                if narrow is not None:
                    gateway = start_gateway(engine.url, narrow, tmp / f"kvgate-{label}.log")
                    page, _ = scrape_view(gateway.url)
                    deadline = time.monotonic() + 10
                    while narrow and page != "narrowed" and time.monotonic() < deadline:
                        time.sleep(0.1)
                        page, _ = scrape_view(gateway.url)
                    assert (page == "narrowed") == narrow, page
                try:
                    share, seen = phase(pid, args.seconds, gateway.url if gateway else None)
                finally:
                    if gateway is not None:
                        gateway.stop(grace_s=10)
                rows.setdefault(label, []).append(share)
                latencies.setdefault(label, []).extend(seen)
                time.sleep(2)
    finally:
        engine.stop()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds of {args.seconds:g} s")
    print()
    print("| page | bytes | GET, median of 40 |")
    print("| --- | ---: | ---: |")
    print(f"| full `/metrics` | {full_size:,} | {full_ms:.1f} ms |")
    print(f"| narrowed `/metrics/?name[]=...` | {narrow_size:,} | {narrow_ms:.1f} ms |")
    print()
    print("| vLLM API server while | CPU, share of a core (each round) | kvgate's scrape, median |")
    print("| --- | --- | ---: |")
    for label, shares in rows.items():
        seen = latencies.get(label) or []
        median = f"{statistics.median(seen):.1f} ms" if seen else "-"
        text = ", ".join(f"{100 * s:.1f} %" for s in shares)
        who = "idle" if label == "idle" else f"kvgate scrapes every 50 ms, {label}"
        print(f"| {who} | {text} | {median} |")


if __name__ == "__main__":
    main()
