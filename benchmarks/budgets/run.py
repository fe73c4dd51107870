"""A tenant's budget on three live replicas sharing a redis-server (issue: budgets that
hold across replicas, reserved before the call and settled after).

Two runs, each with fresh processes (`kvgate.testing.budget_run`): three `kvgate serve`
replicas on one redis-server in front of two simulated `gpu-8b` engines, one tenant with
`tokens_per_minute: 20000`, 60 clients sending streamed completions for 70 s (prompts of
100-300 token ids, `max_tokens` 100-500 with `ignore_eos`, `X-Kvgate-Max-Wait-Ms: 2000`,
each refused client sleeping its `retry-after-ms`):

- `synced`: the store up all along;
- `store killed`: the redis-server killed (SIGKILL) at 25 s and started again, empty, at
  45 s: 20 s in which each replica keeps to a third.

Measured per run: the tokens served (the engines' usage) against the bound
20,000 x (1 + 70/60) and 90% of it; the lowest level of the true bucket, rebuilt from the
clients' answers; every budget refusal's Retry-After against the real wait (the true
bucket's refill for it and the tenant's requests waiting before it).

Writes the section `## Measured` of `results.md` next to this script (what comes before
it is kept).

    python benchmarks/budgets/run.py [--seconds 70] [--dry]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from datetime import date
from pathlib import Path

from kvgate.testing.budget_run import BudgetLoad, BudgetRun, run_budget

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.md"
SECTION = "## Measured"


def row(name: str, run: BudgetRun) -> str:
    refusals = run.refusals()
    within = sum(1 for r in refusals if r.error <= 0.2)
    off = sorted(abs(r.retry_after_s - r.real_wait_s) for r in refusals)
    share = within / max(1, len(refusals))
    early, late = run.lowest
    return (
        f"| {name} | {run.served:,} | {run.bound:,.0f} | {run.served / run.bound:.1%} |"
        f" {max(0.0, run.served - run.bound):,.0f} | {early:,.0f}, {late:,.0f} | {run.count(200)} |"
        f" {len(refusals)} | {within} ({share:.0%}) | {_pct(off, 0.5):.2f}, {_pct(off, 0.9):.2f},"
        f" {_pct(off, 1.0):.2f} | {run.count(429) - len(refusals)} | {len(run.others)} |"
    )


def phase(name: str, run: BudgetRun, lo: float, hi: float) -> str:
    refusals = [r for r in run.refusals() if lo <= r.at < hi]
    within = sum(1 for r in refusals if r.error <= 0.2)
    off = sorted(abs(r.retry_after_s - r.real_wait_s) for r in refusals)
    share = within / max(1, len(refusals))
    return (
        f"| {name} ({lo:g}-{hi:g} s) | {len(refusals)} | {within} ({share:.0%}) |"
        f" {_pct(off, 0.5):.2f}, {_pct(off, 0.9):.2f}, {_pct(off, 1.0):.2f} |"
    )


def _pct(values: list[float], q: float) -> float:
    return values[round(q * (len(values) - 1))] if values else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=70.0)
    parser.add_argument("--dry", action="store_true", help="print, do not write results.md")
    args = parser.parse_args()
    load = BudgetLoad(seconds=args.seconds)
    down = (25.0 * args.seconds / 70, 45.0 * args.seconds / 70)
    before = os.getloadavg()[0]
    runs = [
        ("synced", await run_budget(load)),
        (
            "store killed",
            await run_budget(BudgetLoad(seconds=args.seconds, store_down=down, seed=1)),
        ),
    ]
    after = os.getloadavg()[0]
    lines = [
        "| run | tokens served | bound | of bound | over | lowest level (early, late) | 200s"
        " | budget 429s | Retry-After within 20% of the real wait | off by (s): p50, p90, max"
        " | other 429s | other answers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        *(row(name, run) for name, run in runs),
    ]
    down_at, up_at = down
    killed = runs[1][1]
    phases = [
        ("before the kill", 0.0, down_at),
        ("store down", down_at, up_at),
        ("store back", up_at, args.seconds + 5),
    ]
    lines += [
        "",
        "The store-killed run's budget refusals by phase (Retry-After against the real wait):",
        "",
        "| phase | budget 429s | within 20% | off by (s): p50, p90, max |",
        "|---|---:|---:|---|",
        *(phase(name, killed, lo, hi) for name, lo, hi in phases),
    ]
    print("\n".join(lines))
    for name, run in runs:
        worst = sorted(run.refusals(), key=lambda r: -r.error)[:5]
        print(
            name,
            "worst:",
            [(round(r.at, 2), round(r.retry_after_s, 3), round(r.real_wait_s, 3)) for r in worst],
        )
        refused = sorted({a.reason for a in run.answers if a.status == 429})
        print(name, "429s:", refused, "others:", sorted({(a.status, a.reason) for a in run.others}))
    if args.dry:
        return
    head = (
        f"Command: `python benchmarks/budgets/run.py --seconds {args.seconds:g}`"
        f" ({date.today().isoformat()}, {os.cpu_count()} CPUs shared with other work,"
        f" Python {platform.python_version()}; load average {before:.2f} before,"
        f" {after:.2f} after)."
    )
    # The section after SECTION is this run's; what comes before it (the reading) is kept.
    text = RESULTS.read_text() if RESULTS.exists() else "# Budgets across replicas\n"
    before = text.partition(SECTION)[0].rstrip("\n")
    RESULTS.write_text("\n".join([before, "", SECTION, "", head, "", *lines, ""]))


if __name__ == "__main__":
    asyncio.run(main())
