"""Capacity measurement and the grid of runs (loads x policies x seeds), with progress.

Sustainable capacity is measured, not assumed: the 1x mix of the preset's profile is scaled
up and down with `direct` (no gateway) until the highest scale is found at which `direct`
still serves >= 95% of user requests within the SLO with no preemption. That scale becomes
1x; its goodput (output tokens/s of requests completed within their timeout) is the
"sustainable capacity" every policy's goodput is compared with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvgate.bench.metrics import RunResult, Slo, summarize
from kvgate.bench.workload import Shape, offered_tokens_per_s
from kvgate.sim.runs import ClientModel


@dataclass(frozen=True)
class RunSpec:
    """One run: which engines, which traffic, which policy, which seed."""

    preset: str
    nodes: int
    shape: Shape
    load: float
    seed: int
    duration_s: float
    warmup_s: float
    client: ClientModel
    slo: Slo
    label: str  # the policy's name in the report
    policy: str  # the admission policy run
    cancel: bool = True  # propagate client disconnects to the engine
    policy_overrides: dict[str, Any] = field(default_factory=dict)
    queue: bool = True  # requests may wait in the gateway (see `profiles.Variant`)
    order: str = "fair"
    feedback: bool = True


Runner = Callable[[RunSpec], RunResult]


def passes_capacity(run: RunResult) -> bool:
    """The capacity criterion: >= 95% of users within SLO and no preemption."""
    s = summarize(run)
    return bool(s["slo_attainment"] >= 0.95 and s["preemptions"] == 0)


def find_capacity(
    base: RunSpec,
    runner: Runner,
    lo: float = 0.05,
    hi: float = 4.0,
    steps: int = 7,
    on_step: Callable[[float, bool], None] | None = None,
) -> tuple[float, RunResult | None]:
    """Bisect (geometrically) for the largest scale of `base.shape` that `direct` sustains.

    Returns the scale and the passing run at that scale (None if even `lo` fails).
    """
    best: RunResult | None = None
    run = runner(replace(base, shape=base.shape.scaled(hi), load=1.0))
    if passes_capacity(run):
        return hi, run
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        run = runner(replace(base, shape=base.shape.scaled(mid), load=1.0))
        ok = passes_capacity(run)
        if on_step:
            on_step(mid, ok)
        if ok:
            lo, best = mid, run
        else:
            hi = mid
    if best is None:
        run = runner(replace(base, shape=base.shape.scaled(lo), load=1.0))
        best = run if passes_capacity(run) else None
    return lo, best


def find_capacity_near(
    base: RunSpec,
    runner: Runner,
    start: float,
    steps: int = 2,
    widen: int = 4,
    on_step: Callable[[float, bool], None] | None = None,
) -> tuple[float, RunResult | None]:
    """The largest scale of `base.shape` that `direct` sustains, searched from a guess:
    doubling up from `start` while it holds (or halving down until it does), at most
    `widen` times, then `steps` geometric bisections of the bracket. For runs in real time,
    where a bisection from scratch costs too much. Returns the scale and its passing run
    (None if even the lowest scale tried fails)."""

    def trial(scale: float) -> tuple[bool, RunResult]:
        run = runner(replace(base, shape=base.shape.scaled(scale), load=1.0))
        ok = passes_capacity(run)
        if on_step:
            on_step(scale, ok)
        return ok, run

    ok, run = trial(start)
    lo, hi, best = (start, None, run) if ok else (None, start, None)
    for _ in range(widen):
        if lo is not None and hi is not None:
            break
        scale = lo * 2 if lo is not None else (hi or start) / 2
        ok, run = trial(scale)
        if ok:
            lo, best = scale, run
        else:
            hi = scale
    if lo is None or hi is None:
        return (lo if lo is not None else (hi or start)), best
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        ok, run = trial(mid)
        if ok:
            lo, best = mid, run
        else:
            hi = mid
    return lo, best


def tuned_overrides(
    label: str, shape: Shape, nodes: int, capacity_run: RunResult | None
) -> dict[str, Any]:
    """Settings for the static baselines, tuned to the 1x load as an operator would.

    `static-qps`: a token bucket at the 1x mean arrival rate (bursts averaged in), deep
    enough for one 1x burst. `static-concurrency`: the peak number of requests the
    engines ran at 1x (from the capacity run), rounded up.
    """
    if label == "static-qps":
        rate = (shape.chat_rate + shape.long_rate) * nodes
        burst = round(shape.burst_per_node * nodes)
        if shape.burst_every_s > 0:
            rate += burst / shape.burst_every_s
        return {"baseline": {"qps": max(rate, 0.1), "burst": max(1, burst, round(rate))}}
    if label == "static-concurrency":
        peak = 0.0
        if capacity_run is not None and capacity_run.series.get("running"):
            peak = max(capacity_run.series["running"])
        return {"baseline": {"concurrency": max(nodes, math.ceil(peak))}}
    return {}


def run_grid(
    specs: Sequence[RunSpec], runner: Runner, title: str = "benchmark", jobs: int = 1
) -> list[RunResult]:
    """Run every spec (in `jobs` processes when > 1) with a progress bar; results in order.

    Runs are independent and deterministic for their spec, so running them in parallel
    changes nothing but the wall time (virtual time only: a live run must run alone).
    """
    results: list[RunResult | None] = [None] * len(specs)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(title, total=len(specs), last="")

        def done(i: int, run: RunResult) -> None:
            results[i] = run
            s = summarize(run)
            progress.update(
                task,
                advance=1,
                last=f"{run.policy} @ {run.load:g}x seed {run.seed}: "
                f"{s['goodput_tok_s']:,.0f} tok/s",
            )

        if jobs <= 1:
            for i, spec in enumerate(specs):
                progress.update(task, last=f"{spec.label} @ {spec.load:g}x seed {spec.seed}...")
                done(i, runner(spec))
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(runner, spec): i for i, spec in enumerate(specs)}
                for fut in as_completed(futures):
                    done(futures[fut], fut.result())
    return [r for r in results if r is not None]


def describe_capacity(
    scale: float, base: RunSpec, run: RunResult | None, how: str
) -> dict[str, Any]:
    """The capacity section of the report."""
    shape = base.shape.scaled(scale)
    out: dict[str, Any] = {
        "how": how,
        "scale of the profile's mix": f"{scale:.3f}",
        "1x chat arrivals/s (cluster)": f"{shape.chat_rate * base.nodes:.2f}",
        "1x long arrivals/s (cluster)": f"{shape.long_rate * base.nodes:.3f}",
        "1x burst": f"{round(shape.burst_per_node * base.nodes)} long requests "
        f"every {shape.burst_every_s:g} s",
        "1x offered output tok/s": f"{offered_tokens_per_s(shape, base.nodes, 1.0):,.0f}",
    }
    if run is not None:
        s = summarize(run)
        out["goodput_tok_s"] = round(s["goodput_tok_s"], 1)
        out["direct at 1x: in SLO"] = f"{s['slo_attainment']:.1%}"
        out["direct at 1x: preemptions"] = s["preemptions"]
    return out
