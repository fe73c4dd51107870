"""What a benchmark run measured, reduced to the numbers the report compares.

Both the virtual-time runner and the live load generator write the same records: one
`UserRequest` per request a user wanted served, holding every `Attempt` the client made for
it (a retry is a new attempt, a 429 is an attempt that never reached an engine). Engine
totals and time series come from the engines. Everything in the summary is derived from
these records, so the virtual and the live benchmark are scored by the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvgate.sim.runs import ERROR as ERROR
from kvgate.sim.runs import OK as OK
from kvgate.sim.runs import OUTCOMES as OUTCOMES
from kvgate.sim.runs import SHED as SHED
from kvgate.sim.runs import TIMEOUT as TIMEOUT
from kvgate.sim.runs import UNAVAILABLE as UNAVAILABLE
from kvgate.sim.runs import Attempt as Attempt


# How an attempt ended, and the per-try record itself, are the simulator's: the virtual runs
# produce them directly and the live load generator writes the same ones.
@dataclass(slots=True)
class UserRequest:
    """A request a user wanted answered, with all the tries their client made."""

    id: str
    kind: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    timeout_s: float
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def success(self) -> Attempt | None:
        """The attempt that delivered the whole answer, if any (always the last one)."""
        if self.attempts and self.attempts[-1].outcome == OK:
            return self.attempts[-1]
        return None

    @property
    def completed_at(self) -> float | None:
        ok = self.success
        return None if ok is None else ok.end


@dataclass(frozen=True, slots=True)
class Slo:
    """The explicit service-level objective a request must meet to count as "within SLO".

    TTFT is measured from the user's *first* try, so time spent waiting out a 429 or a
    failed attempt counts against the gateway, not just the lucky last attempt.
    """

    ttft_s: float
    tpot_s: float
    long_ttft_s: float  # long prompts need a prefill a chat turn does not

    def ttft_for(self, kind: str) -> float:
        return self.long_ttft_s if kind == "long" else self.ttft_s


@dataclass(slots=True)
class EngineTotals:
    """Counters summed over all engines for the whole run."""

    preemptions: int = 0
    recomputed_tokens: int = 0
    zombie_tokens: int = 0
    generated_tokens: int = 0


@dataclass(slots=True)
class RunResult:
    """Everything one run (one policy, one load, one seed) produced."""

    policy: str
    load: float
    seed: int
    preset: str
    nodes: int
    duration_s: float
    warmup_s: float
    slo: Slo
    requests: list[UserRequest]
    totals: EngineTotals
    series: dict[str, list[float]] = field(default_factory=dict)
    bursts: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def within_slo(req: UserRequest, slo: Slo) -> bool:
    """Completed, first token soon enough after the user first asked, tokens fast enough."""
    ok = req.success
    if ok is None or ok.first_token_at is None:
        return False
    eps = 1e-9  # float noise must not decide a boundary case
    if ok.first_token_at - req.arrival > slo.ttft_for(req.kind) + eps:
        return False
    tpot = ok.tpot
    return tpot is None or tpot <= slo.tpot_s + eps


def summarize(run: RunResult) -> dict[str, Any]:
    """The summary row of one run: goodput, SLO share, latency, waste, retries, recovery.

    Only user requests that *arrived* in the measurement window [warmup, duration) count,
    so a run is not credited for the easy start nor blamed for requests cut off at the end.
    """
    lo, hi = run.warmup_s, run.duration_s
    window = max(hi - lo, 1e-9)
    reqs = [r for r in run.requests if lo <= r.arrival < hi]
    done = [r for r in reqs if r.success is not None]
    attempts = [a for r in reqs for a in r.attempts]
    admitted = [a for a in attempts if a.admitted]
    ttfts = [a.ttft for a in admitted if a.ttft is not None]
    tpots = [t for t in (a.tpot for a in admitted) if t is not None]
    retry_afters = [a.retry_after_s for a in attempts if a.retry_after_s is not None]
    good_tokens = sum(r.success.output_tokens for r in done if r.success is not None)
    n = len(reqs)
    by_kind = {kind: [r for r in reqs if r.kind == kind] for kind in sorted({r.kind for r in reqs})}
    return {
        "policy": run.policy,
        "load": run.load,
        "seed": run.seed,
        "user_requests": n,
        "completed": len(done),
        "goodput_tok_s": good_tokens / window,
        "goodput_req_s": len(done) / window,
        "slo_attainment": sum(within_slo(r, run.slo) for r in reqs) / n if n else math.nan,
        **{
            f"served_{kind}": sum(r.success is not None for r in group) / len(group)
            for kind, group in by_kind.items()
        },
        **{
            f"slo_{kind}": sum(within_slo(r, run.slo) for r in group) / len(group)
            for kind, group in by_kind.items()
        },
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p99_s": _pct(ttfts, 99),
        "tpot_p50_s": _pct(tpots, 50),
        "tpot_p99_s": _pct(tpots, 99),
        "preemptions": run.totals.preemptions,
        "recomputed_tokens": run.totals.recomputed_tokens,
        "zombie_tokens": run.totals.zombie_tokens,
        "attempts_per_request": len(attempts) / n if n else math.nan,
        "timeouts": sum(a.outcome == TIMEOUT for a in attempts),
        "rejected_429": sum(a.outcome == SHED for a in attempts),
        "rejected_503": sum(a.outcome == UNAVAILABLE for a in attempts),
        "errors": sum(a.outcome == ERROR for a in attempts),
        "gave_up": n - len(done),
        "retry_after_p50_s": _pct(retry_afters, 50),
        "retry_after_max_s": max(retry_afters) if retry_afters else math.nan,
        "recovery_s": recovery_time(run),
        **{f"queue_{key}": value for key, value in queue_figures(run).items()},
    }


QUEUE_KEYS = ("peak_waiting", "queued", "started_after_wait", "wait_mean_s", "wait_p90_s")


def queue_figures(run: RunResult) -> dict[str, float]:
    """The gateway's queue over the whole run (`QUEUE_KEYS`; NaN where unknown).

    A live run through kvgate carries the gateway's own account (`extra["gateway_queue"]`,
    see `kvgate.bench.gateway_queue`: its waits are every wait, however it ended). A virtual
    run knows each started request's wait exactly (`Attempt.waited_s`) and how many waited
    at each step (the `queued` series), not how many joined the queue in all. A run with
    neither (straight to the engines, live) has no figures.
    """
    told = run.extra.get("gateway_queue")
    if isinstance(told, dict):
        return {key: float(told.get(key, math.nan)) for key in QUEUE_KEYS}
    waiting = [w for w in run.series.get("queued", ()) if not math.isnan(w)]
    waits = [a.waited_s for r in run.requests for a in r.attempts if a.waited_s > 0]
    if not waiting and not waits:
        return dict.fromkeys(QUEUE_KEYS, math.nan)
    return {
        "peak_waiting": max(waiting, default=math.nan),
        "queued": math.nan,
        "started_after_wait": float(len(waits)),
        "wait_mean_s": float(np.mean(waits)) if waits else math.nan,
        "wait_p90_s": _pct(waits, 90),
    }


def retry_after_histogram(run: RunResult) -> dict[int, int]:
    """How many 429/503 answers said "retry after N seconds", by whole N (rounded up)."""
    counts: dict[int, int] = {}
    for req in run.requests:
        for a in req.attempts:
            if a.retry_after_s is not None:
                key = math.ceil(a.retry_after_s)
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def windowed(run: RunResult, step_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per-window client-side series: goodput, completions, sheds, admitted TTFT p50/p99.

    A completion is put in the window it finished in; an attempt in the window it started.
    """
    end = max([run.duration_s, *run.series.get("t", [])])
    bins = max(1, math.ceil(end / step_s))
    t = np.arange(bins) * step_s
    good = np.zeros(bins)
    done = np.zeros(bins)
    sent = np.zeros(bins)
    shed = np.zeros(bins)
    admitted = np.zeros(bins)
    timeouts = np.zeros(bins)
    ttft_lists: list[list[float]] = [[] for _ in range(bins)]

    def idx(when: float) -> int:
        return min(bins - 1, max(0, int(when // step_s)))

    for req in run.requests:
        ok = req.success
        if ok is not None:
            good[idx(ok.end)] += ok.output_tokens
            done[idx(ok.end)] += 1
        for a in req.attempts:
            sent[idx(a.start)] += 1
            if a.outcome == SHED:
                shed[idx(a.start)] += 1
            if a.admitted:
                admitted[idx(a.start)] += 1
            elif a.outcome == TIMEOUT:
                timeouts[idx(a.end)] += 1
            if a.admitted and a.ttft is not None:
                ttft_lists[idx(a.start)].append(a.ttft)
    p50 = np.array([np.percentile(v, 50) if v else np.nan for v in ttft_lists])
    p99 = np.array([np.percentile(v, 99) if v else np.nan for v in ttft_lists])
    return {
        "t": t,
        "goodput_tok_s": good / step_s,
        "completed_req_s": done / step_s,
        "attempts_s": sent / step_s,
        "shed_s": shed / step_s,
        "admitted_s": admitted / step_s,
        "timeouts_s": timeouts / step_s,
        "ttft_p50_s": p50,
        "ttft_p99_s": p99,
    }


def recovery_time(run: RunResult, settle_s: float = 2.0) -> float:
    """Mean time from each burst until the engines' queues are back to their pre-burst level.

    "Back" means the cluster's total `waiting` count stays at or under its 90th percentile
    of the 10 s before the burst (plus one per node, so an idle cluster is not held to zero)
    for `settle_s`, with no preemption in that span. A burst not recovered from before the
    next one (or the end) counts the whole gap: the number is then a lower bound, and
    `run.extra["unrecovered_bursts"]` says how many.
    """
    s = run.series
    if not run.bursts or "t" not in s or "waiting" not in s or len(s["t"]) < 2:
        return math.nan
    t = np.asarray(s["t"], dtype=float)
    waiting = np.asarray(s["waiting"], dtype=float)
    pre = np.asarray(s.get("preemptions", np.zeros_like(t)), dtype=float)
    step = float(t[1] - t[0])
    need = max(1, math.ceil(settle_s / step))
    ends = [*run.bursts[1:], run.duration_s]
    times: list[float] = []
    unrecovered = 0
    for start, stop in zip(run.bursts, ends, strict=True):
        before = waiting[(t >= start - 10.0) & (t < start)]
        limit = (np.percentile(before, 90) if before.size else 0.0) + run.nodes
        ok = (waiting <= limit) & (pre <= 0)
        span = np.nonzero((t >= start) & (t < stop))[0]
        found = None
        for k in span:
            if k + need <= len(ok) and ok[k : k + need].all():
                found = float(t[k] - start)
                break
        if found is None:
            unrecovered += 1
            found = float(stop - start)
        times.append(found)
    run.extra["unrecovered_bursts"] = unrecovered
    return float(np.mean(times))
