"""The long chaos soak: the CI soak (`tests/reliability/test_soak.py`) run for longer.

    python benchmarks/soak/run_soak.py --seconds 300 --workers 24

Starts `kvgate serve` as a child process in front of simulated engines behind fault
injectors (`kvgate.testing.chaos`), drives it with cancelling and malformed clients for the
given time, then checks the books (in-flight requests, tickets, reservations, tenant
usage, engine queues: all exactly zero), the RSS growth, the log and that it still
serves. Writes the figures to `results.md` next to this file (`--out` to change) and exits
non-zero if anything was found.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path

from kvgate.testing.soak import run_soak
from kvgate.testing.soak_report import SoakReport, SoakSettings, summary

HERE = Path(__file__).resolve().parent


def render(report: SoakReport, command: str) -> str:
    s = report.settings
    st = report.statuses
    errors = sum(v for k, v in st.items() if not k.startswith("200"))
    lines = [
        "# Chaos soak results",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, shared 2-core box; "
        f"run {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        f"Setup: `kvgate serve` (uvicorn, adaptive policy, 3 API keys/tenants, one tenant "
        f"limited) in front of {s.nodes} simulated `cpu-tiny` vLLM engines behind "
        f"`kvgate.testing.chaos` fronts; {s.workers} client workers for {s.duration_s:.0f} s "
        f"after a {s.warmup_s:.0f} s warm-up; a fault every {s.fault_interval_s} s on "
        "average (seed "
        f"{s.seed}).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests sent | {report.requests:,} |",
        f"| completed (200) | {st['200']:,} (+{st['200+sse_error']:,} streams ended by an SSE "
        "error event) |",
        f"| well-formed errors | {errors:,} |",
        f"| cancellations (before headers / waiting / mid-stream) | {report.cancellations:,} "
        f"({report.actions['cancel_before_headers']:,} / {report.actions['cancel_waiting']:,} / "
        f"{report.actions['cancel_mid_stream']:,}) |",
        f"| malformed requests / slow clients | {report.actions['malformed']:,} / "
        f"{report.actions['slow_client']:,} |",
        f"| faults injected | {report.faults_injected:,} |",
        f"| engine crashes (restarts) | {report.faults['crash']} ({report.faults['restart']}) |",
        f"| connections reset (by crashes + at random) | "
        f"{report.faults['connections_reset_by_crash'] + report.faults['reset_connections']:,} |",
        f"| streams stalled mid-answer | {report.faults['stall_connections']:,} |",
        f"| metrics hung / garbage / HTTP 500 episodes | {report.faults['metrics_hang']} / "
        f"{report.faults['metrics_garbage']} / {report.faults['metrics_error']} |",
        f"| failed scrapes / scrape-failure log lines | {report.scrape_failures:,} / "
        f"{report.scrape_warnings:,} |",
        f"| responses that were neither correct nor a well-formed error | "
        f"{len(report.violations)} |",
        f"| **leaks found** (in-flight, tickets, reservations, tenant usage, engine queues) | "
        f"**{report.leaks_found}** |",
        f"| gateway RSS: start / after warm-up / end / peak | {report.rss_start_kib / 1024:.1f} / "
        f"{report.rss_warm_kib / 1024:.1f} / {report.rss_end_kib / 1024:.1f} / "
        f"{report.rss_peak_kib / 1024:.1f} MiB |",
        f"| RSS growth after warm-up (bound) | {report.rss_growth_mib:+.1f} MiB "
        f"({s.rss_growth_bound_mib:.0f} MiB) |",
        f"| tracebacks / errors in the gateway log | {report.log_errors} |",
        f"| still serves afterwards | {'yes' if report.still_serves else 'NO'} |",
        f"| verdict | {'pass' if report.ok else 'FAIL'} |",
        "",
        "Statuses seen (with `X-Kvgate-Reason` where the gateway set one):",
        "",
        "| status | count |",
        "|---|---|",
        *[f"| {k} | {v:,} |" for k, v in sorted(st.items())],
        "",
        "Raw summary:",
        "",
        "```",
        summary(report),
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--workers", type=int, default=24)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--fault-interval", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rss-bound-mib", type=float, default=32.0)
    parser.add_argument("--out", type=Path, default=HERE / "results.md")
    args = parser.parse_args()
    settings = SoakSettings(
        duration_s=args.seconds,
        workers=args.workers,
        nodes=args.nodes,
        fault_interval_s=args.fault_interval,
        seed=args.seed,
        rss_growth_bound_mib=args.rss_bound_mib,
    )
    report = asyncio.run(run_soak(settings))
    print(summary(report))
    command = "python benchmarks/soak/run_soak.py " + " ".join(sys.argv[1:])
    args.out.write_text(render(report, command.strip()))
    print(f"wrote {args.out}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
