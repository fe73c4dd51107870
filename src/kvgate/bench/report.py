"""Turn benchmark runs into a Markdown report with matplotlib plots and a JSON dump.

The report states the command and seeds that made it, the scenario, the SLO and how the
sustainable capacity was measured, a summary table per load and policy (mean over seeds),
the issue's bar checked mechanically, and time-series plots per policy.
"""

from __future__ import annotations

import gzip
import json
import math
import pickle
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.bench.metrics import RunResult, retry_after_histogram, summarize, windowed

# Columns of the summary table: key, header, format.
COLUMNS: list[tuple[str, str, str]] = [
    ("goodput_tok_s", "goodput tok/s", "{:,.0f}"),
    ("goodput_pct", "% of capacity", "{:.0f}%"),
    ("goodput_req_s", "done req/s", "{:.2f}"),
    ("slo_attainment", "in SLO", "{:.0%}"),
    ("served_chat", "chats served", "{:.0%}"),
    ("slo_chat", "chats in SLO", "{:.0%}"),
    ("served_long", "longs served", "{:.0%}"),
    ("slo_long", "longs in SLO", "{:.0%}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("tpot_p50_s", "TPOT p50 ms", "ms"),
    ("tpot_p99_s", "TPOT p99 ms", "ms"),
    ("preemptions", "preempt.", "{:,.0f}"),
    ("recomputed_tokens", "recomputed tok", "{:,.0f}"),
    ("zombie_tokens", "zombie tok", "{:,.0f}"),
    ("attempts_per_request", "tries/req", "{:.2f}"),
    ("rejected_429", "429s", "{:,.0f}"),
    ("timeouts", "timeouts", "{:,.0f}"),
    ("gave_up", "gave up", "{:,.0f}"),
    ("recovery_s", "recovery s", "{:.1f}"),
]


@dataclass
class ReportMeta:
    """What the report says about how it was made."""

    title: str
    command: str
    seeds: list[int]
    scenario: dict[str, Any]
    slo: dict[str, str]  # criterion -> bound, as the report prints it
    capacity: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    focus_load: float = 3.0


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if spec == "ms":
        return f"{value * 1000:.0f}"
    return spec.format(value)


def aggregate(runs: Sequence[RunResult], capacity_tok_s: float) -> list[dict[str, Any]]:
    """Mean of each summary field over the seeds of every (load, policy), in run order."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run.load, run.policy)].append(summarize(run))
    rows = []
    for (load, policy), items in groups.items():
        row: dict[str, Any] = {"load": load, "policy": policy, "seeds": len(items)}
        for key in items[0]:
            vals = [i[key] for i in items if isinstance(i.get(key), (int, float))]
            if key in ("load", "seed", "policy"):
                continue
            finite = [v for v in vals if not math.isnan(v)]
            row[key] = float(np.mean(finite)) if finite else math.nan
        row["goodput_pct"] = (
            100.0 * row["goodput_tok_s"] / capacity_tok_s if capacity_tok_s > 0 else math.nan
        )
        rows.append(row)
    rows.sort(key=lambda r: (r["load"], _policy_order(r["policy"])))
    return rows


_ORDER = ["direct", "static-qps", "static-concurrency", "seed", "adaptive", "adaptive-nocancel"]


_COLORS = {
    "direct": "tab:blue",
    "static-qps": "tab:orange",
    "static-concurrency": "tab:green",
    "seed": "tab:red",
    "adaptive": "tab:purple",
    "adaptive-nocancel": "black",
}


def _style(name: str) -> dict[str, Any]:
    """One colour per policy in every plot; the no-cancellation variant dashed."""
    return {"color": _COLORS.get(name), "ls": "--" if name.endswith("nocancel") else "-"}


def _policy_order(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


# Columns of the queue table (`metrics.queue_figures`, prefixed `queue_` in a row).
QUEUE_COLUMNS: list[tuple[str, str, str]] = [
    ("queue_peak_waiting", "most waiting", "{:,.0f}"),
    ("queue_queued", "queued", "{:,.0f}"),
    ("queue_started_after_wait", "started after waiting", "{:,.0f}"),
    ("queue_wait_mean_s", "mean wait s", "{:.2f}"),
    ("queue_wait_p90_s", "p90 wait s", "{:.2f}"),
]


def summary_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]] = COLUMNS
) -> str:
    """A Markdown table with one row per load and policy (the summary by default)."""
    head = ["load", "policy", *[h for _, h, _ in columns]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row['load']:g}x", f"`{row['policy']}`"]
        cells += [_fmt(row.get(k), spec) for k, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def queue_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The report's section on the gateway's queue: the rows of runs that had one."""
    queued = [r for r in rows if _known(r.get("queue_peak_waiting"))]
    if not queued:
        return []
    return [
        "## The gateway's queue",
        "",
        "Requests that could not start at once and waited in kvgate for room (mean over"
        " seeds). Live runs: kvgate's own counters and its `kvgate_queue_wait_seconds`"
        " histogram (every wait however it ended; p90 interpolated within its bucket)."
        " Virtual runs: the waits of the requests that started (how many joined the queue"
        " in all is not recorded).",
        "",
        summary_table(queued, QUEUE_COLUMNS),
        "",
    ]


def _known(value: Any) -> bool:
    return isinstance(value, int | float) and not math.isnan(value)


def check_bar(rows: Sequence[dict[str, Any]], load: float) -> list[str]:
    """The issue's bar at `load`, checked on the numbers; one line per claim, with a verdict."""
    at = {r["policy"]: r for r in rows if r["load"] == load}
    out = []
    a = at.get("adaptive")
    if a is not None:
        ok = a["goodput_pct"] >= 90.0
        out.append(
            f"- {'PASS' if ok else 'FAIL'}: `adaptive` goodput at {load:g}x is "
            f"{a['goodput_pct']:.0f}% of sustainable capacity (bar: >= 90%)."
        )
        out.append(
            f"- {'PASS' if a['preemptions'] == 0 else 'FAIL'}: `adaptive` preemptions: "
            f"{a['preemptions']:,.1f} (bar: none)."
        )
        out.append(
            f"- {'PASS' if a['zombie_tokens'] == 0 else 'FAIL'}: `adaptive` zombie tokens: "
            f"{a['zombie_tokens']:,.0f} (bar: zero)."
        )
    peak = [r for r in rows if r["policy"] == "direct"]
    if a is not None and peak:
        best = max(peak, key=lambda r: r["goodput_tok_s"])
        if best["goodput_tok_s"] > 0:
            out.append(
                f"- for reference: `direct`'s own peak goodput was {best['goodput_tok_s']:,.0f} "
                f"tok/s (at {best['load']:g}x); `adaptive` at {load:g}x reached "
                f"{100 * a['goodput_tok_s'] / best['goodput_tok_s']:.0f}% of that."
            )
    for name in ("direct", "static-qps"):
        r = at.get(name)
        if r is not None:
            lost = r["goodput_pct"] < 50.0
            out.append(
                f"- {'PASS' if lost else 'FAIL'}: `{name}` goodput at {load:g}x is "
                f"{r['goodput_pct']:.0f}% of capacity (bar: loses most of it, < 50%); "
                f"{r['slo_attainment']:.0%} of its users within SLO."
            )
    return out


def _pick(runs: Sequence[RunResult], load: float) -> dict[str, RunResult]:
    """One run per policy at `load`: the one with the lowest seed (plots show one seed)."""
    chosen: dict[str, RunResult] = {}
    for run in sorted(runs, key=lambda r: r.seed):
        if run.load == load and run.policy not in chosen:
            chosen[run.policy] = run
    return dict(sorted(chosen.items(), key=lambda kv: _policy_order(kv[0])))


def plot_timeseries(runs: dict[str, RunResult], path: Path, title: str) -> Path:
    """Stacked panels, one line per policy: KV, running, waiting, admits, sheds, goodput, TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("kv_usage_max", "max KV usage (0-1)"),
        ("running", "running (all nodes)"),
        ("waiting", "waiting (all nodes)"),
        ("admitted_s", "admitted /s"),
        ("rejected_s", "rejected (429) /s"),
        ("queued", "waiting in kvgate"),
        ("goodput_tok_s", "goodput tok/s (5 s avg)"),
        ("ttft_p99_s", "TTFT p99 s (admitted)"),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.0 * len(panels)), sharex=True)
    for name, run in runs.items():
        series = _series_for_plot(run)
        for ax, (key, _label) in zip(axes, panels, strict=True):
            if key in series:
                ax.plot(series["t_" + key], series[key], label=name, lw=1.0, **_style(name))
        for b in run.bursts:
            for ax in axes:
                ax.axvline(b, color="grey", lw=0.5, ls=":")
    for ax, (_key, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    labelled = [ax for ax in axes if ax.get_lines()]
    if labelled:
        labelled[0].legend(ncol=min(6, len(runs)), fontsize=8, loc="upper left")
    axes[-1].set_xlabel("time (s); dotted lines: bursts")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _series_for_plot(run: RunResult) -> dict[str, np.ndarray]:
    """Engine series (from the runner) plus client series (from the records), with x axes."""
    out: dict[str, np.ndarray] = {}
    s = run.series
    if "t" in s:
        t = np.asarray(s["t"], dtype=float)
        step = float(t[1] - t[0]) if len(t) > 1 else 1.0
        for key in ("kv_usage_max", "kv_usage_mean", "running", "waiting", "queued"):
            if key in s:
                out[key], out["t_" + key] = np.asarray(s[key], dtype=float), t
        for key in ("admitted", "rejected"):
            if key in s:
                out[key + "_s"] = np.asarray(s[key], dtype=float) / step
                out["t_" + key + "_s"] = t
    w = windowed(run, 1.0)
    kernel = np.ones(5) / 5
    out["goodput_tok_s"] = np.convolve(w["goodput_tok_s"], kernel, mode="same")
    out["t_goodput_tok_s"] = w["t"]
    out["ttft_p99_s"], out["t_ttft_p99_s"] = w["ttft_p99_s"], w["t"]
    if "rejected_s" not in out:
        out["rejected_s"], out["t_rejected_s"] = w["shed_s"], w["t"]
    if "admitted_s" not in out:
        out["admitted_s"], out["t_admitted_s"] = w["admitted_s"], w["t"]
    return out


def plot_goodput_vs_load(
    rows: Sequence[dict[str, Any]], capacity_tok_s: float, path: Path, title: str
) -> Path:
    """Goodput (% of capacity) against offered load, one line per policy: the headline plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_policy[row["policy"]].append(row)
    for name in sorted(by_policy, key=_policy_order):
        pts = sorted(by_policy[name], key=lambda r: r["load"])
        loads = [r["load"] for r in pts]
        ax1.plot(loads, [r["goodput_pct"] for r in pts], marker="o", label=name, **_style(name))
        ax2.plot(
            loads, [100 * r["slo_attainment"] for r in pts], marker="o", label=name, **_style(name)
        )
    ax1.axhline(90, color="grey", ls="--", lw=0.8)
    ax1.set_ylabel(f"goodput, % of capacity ({capacity_tok_s:,.0f} tok/s)")
    ax2.set_ylabel("user requests within SLO, %")
    for ax in (ax1, ax2):
        ax.set_xlabel("offered load (x sustainable capacity)")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(
    runs: Sequence[RunResult], meta: ReportMeta, out_dir: Path, keep: bool = False
) -> Path:
    """Write report.md, the PNGs and results.json into `out_dir`; return the report's path.

    With `keep`, the full records are also pickled under the temp dir (see `rewrite`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cap = float(meta.capacity.get("goodput_tok_s", 0.0))
    rows = aggregate(runs, cap)
    loads = sorted({r.load for r in runs})
    head = plot_goodput_vs_load(rows, cap, out_dir / "goodput_vs_load.png", meta.title)
    series_pngs = []
    for load in loads:
        picked = _pick(runs, load)
        if picked:
            name = f"timeseries_{load:g}x.png"
            seed = next(iter(picked.values())).seed
            plot_timeseries(picked, out_dir / name, f"{meta.title}: {load:g}x load, seed {seed}")
            series_pngs.append((load, name))
    lines = [f"# {meta.title}", "", "Made by:", "", "```bash", meta.command, "```", ""]
    lines += [f"Seeds: {', '.join(map(str, meta.seeds))} (table: mean over seeds).", ""]
    lines += ["## Scenario", "", *_kv_lines(meta.scenario), ""]
    lines += ["## SLO", "", *_kv_lines(meta.slo), ""]
    lines += ["## Sustainable capacity", "", *_kv_lines(meta.capacity)]
    if rows:
        top = max(rows, key=lambda r: r["goodput_tok_s"])
        lines.append(
            f"- for scale: the highest goodput any policy reached was "
            f"{top['goodput_tok_s']:,.0f} tok/s (`{top['policy']}` at {top['load']:g}x)"
        )
    lines.append("")
    if meta.focus_load in loads:
        lines += [f"## The bar, at {meta.focus_load:g}x", "", *check_bar(rows, meta.focus_load), ""]
    lines += ["## Summary", "", summary_table(rows), ""]
    lines += queue_lines(rows)
    lines += [f"![goodput against load]({head.name})", ""]
    if meta.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in meta.notes], ""]
    lines += ["## Time series", ""]
    for load, name in series_pngs:
        lines += [f"### {load:g}x", "", f"![time series at {load:g}x]({name})", ""]
    lines += [
        "## Retry-After values sent at the focus load (one seed per policy; whole s, rounded up)",
        "",
    ]
    for policy, run in _pick(runs, meta.focus_load).items():
        hist = retry_after_histogram(run)
        if hist:
            shown = ", ".join(f"{k}s: {v}" for k, v in hist.items())
            lines.append(f"- `{policy}` (seed {run.seed}): {shown}")
    lines.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    if keep:
        _keep_records(runs, meta, out_dir)
    dump = {
        "meta": meta.__dict__,
        "rows": rows,
        # `_`-keys of `extra` are raw records kept for the pickle, not for the JSON.
        "runs": [
            summarize(r) | {"extra": {k: v for k, v in r.extra.items() if k[:1] != "_"}}
            for r in runs
        ],
    }
    (out_dir / "results.json").write_text(json.dumps(dump, indent=1, default=str), "utf-8")
    return report


def _keep_records(runs: Sequence[RunResult], meta: ReportMeta, out_dir: Path) -> None:
    """Keep the full records outside the repository, so the report can be re-made."""
    keep = Path(tempfile.gettempdir()) / "kvgate-bench" / f"{out_dir.resolve().name}.pickle.gz"
    keep.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(keep, "wb") as fh:
        pickle.dump((list(runs), meta), fh)


def rewrite(pickled: Path, out_dir: Path) -> Path:
    """Re-make a report from the records a run kept (`python -m kvgate.bench.report P OUT`)."""
    with gzip.open(pickled, "rb") as fh:
        runs, meta = pickle.load(fh)
    return write_report(runs, meta, out_dir)


def _kv_lines(d: dict[str, Any]) -> list[str]:
    return [f"- {k}: {v}" for k, v in d.items()]


if __name__ == "__main__":
    print(rewrite(Path(sys.argv[1]), Path(sys.argv[2])))
