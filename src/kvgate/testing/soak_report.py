"""The chaos soak's settings and its report: what was sent, what went wrong, what leaked.

`SoakReport.ok` is the verdict of one run (no violation, no leak, still serving, no error
in the gateway's log, RSS growth within the bound); `summary` renders it for a human.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SoakSettings:
    duration_s: float = 60.0
    warmup_s: float = 4.0
    nodes: int = 3
    workers: int = 24
    seed: int = 1
    fault_interval_s: float = 0.25
    rss_growth_bound_mib: float = 48.0
    gateway_log: str | None = None  # where to keep the gateway's log (default: temp dir)


@dataclass
class SoakReport:
    settings: SoakSettings
    requests: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    leaks: dict[str, Any] = field(default_factory=dict)
    rss_start_kib: int = 0
    rss_warm_kib: int = 0
    rss_end_kib: int = 0
    rss_peak_kib: int = 0
    elapsed_s: float = 0.0
    scrape_warnings: int = 0
    scrape_failures: int = 0
    log_errors: int = 0
    still_serves: bool = False

    @property
    def cancellations(self) -> int:
        return sum(v for k, v in self.actions.items() if k.startswith("cancel"))

    @property
    def faults_injected(self) -> int:
        """Crashes, metrics episodes, random resets and stalls (not their consequences:
        restarts and the connections a crash reset)."""
        skip = ("restart", "connections_reset_by_crash")
        return sum(v for k, v in self.faults.items() if k not in skip)

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_end_kib - self.rss_warm_kib) / 1024

    @property
    def leaks_found(self) -> int:
        return sum(1 for v in self.leaks.values() if v)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and self.leaks_found == 0
            and self.still_serves
            and self.log_errors == 0
            and self.rss_growth_mib <= self.settings.rss_growth_bound_mib
        )

    def violation(self, text: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(text)


def summary(report: SoakReport) -> str:
    """A short human-readable account of one soak."""
    s = report.settings
    lines = [
        f"soak: {report.requests} requests in {s.duration_s:.0f} s ({s.workers} workers, "
        f"{s.nodes} engines), {report.cancellations} cancellations, "
        f"{report.actions['malformed']} malformed, {report.faults_injected} faults injected",
        f"statuses: {dict(sorted(report.statuses.items()))}",
        f"faults: {dict(sorted(report.faults.items()))}",
        f"leaks found: {report.leaks_found} {report.leaks if report.leaks_found else ''}",
        f"RSS: start {report.rss_start_kib / 1024:.1f} MiB, after warm-up "
        f"{report.rss_warm_kib / 1024:.1f} MiB, end {report.rss_end_kib / 1024:.1f} MiB "
        f"(growth {report.rss_growth_mib:+.1f} MiB, bound {s.rss_growth_bound_mib:.0f} MiB), "
        f"peak {report.rss_peak_kib / 1024:.1f} MiB",
        f"scrape failures {report.scrape_failures}, logged {report.scrape_warnings} times; "
        f"log errors {report.log_errors}; still serves: {report.still_serves}",
        f"violations: {len(report.violations)}",
        *[f"  - {v}" for v in report.violations[:20]],
    ]
    return "\n".join(lines)
