"""The overload benchmark in virtual time: a `RunSpec` played on `kvgate.sim.virtual`.

This module only translates. The discrete-event loop, the engines, the gateway replicas and
the client model (`ClientModel`, whole-answer deadline, retries, Retry-After) all live in
`kvgate.sim.virtual`, the simulator's virtual-time mode; here a `RunSpec` becomes a
`VirtualConfig` plus the scenario's seeded arrivals, and the simulator's per-request,
per-attempt records and time series become the `RunResult` the report scores.

`direct` is the `none` policy: no admission, requests spread least-connections, client
disconnects reach the engine, exactly as if clients talked to the engines through a plain
load balancer. `cancel=False` runs engines that do not abort on disconnect, and a gateway
that keeps each abandoned request's reservation until the engine finishes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvgate.bench.metrics import EngineTotals, RunResult, UserRequest
from kvgate.bench.suite import RunSpec
from kvgate.bench.workload import Arrival, burst_times, generate
from kvgate.core.policies.baselines import BaselineOptions, policy_name
from kvgate.core.request import Priority
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.sim.presets import get_preset
from kvgate.sim.runs import NO_QUEUE, VirtualConfig, VirtualResult
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import RequestSpec, WorkloadSpec

SCRAPE_S = 0.05  # as the gateway scrapes
SCRAPE_LAG_S = 0.01
SERIES_STEP_S = 0.5
TOKEN_UPDATE_S = 0.25


def virtual_config(spec: RunSpec) -> VirtualConfig:
    """The simulator configuration of one benchmark run (its arrivals come separately)."""
    engine = dataclasses.replace(get_preset(spec.preset), abort_on_disconnect=spec.cancel)
    overrides = dict(spec.policy_overrides)
    baseline = BaselineOptions(**overrides.pop("baseline", {}))
    settings = AdmissionSettings(**overrides)
    queue = QueueSettings() if spec.queue else NO_QUEUE
    return VirtualConfig(
        engine=engine,
        workload=WorkloadSpec(rate_rps=0.0),  # unused: the scenario's arrivals are passed in
        duration_s=spec.duration_s,
        nodes=spec.nodes,
        gateways=1,
        admission=settings,
        policy=policy_name(spec.policy),
        baseline=baseline,
        queue=queue,
        order="fcfs" if spec.order == "fcfs" else "fair",
        feedback=spec.feedback,
        scrape_interval_s=SCRAPE_S,
        scrape_lag_s=SCRAPE_LAG_S,
        client=spec.client,
        series_interval_s=SERIES_STEP_S,
        token_update_interval_s=TOKEN_UPDATE_S,
        # Long enough for the last arrival's client to get its answer or time out.
        drain_s=spec.client.timeout_s + 1.0,
        seed=spec.seed,
    )


def request_specs(arrivals: Sequence[Arrival]) -> list[RequestSpec]:
    """The scenario's users as simulator requests: standard priority, streamed, no EOS."""
    return [
        RequestSpec(
            index=i,
            arrival=a.t,
            prompt_tokens=a.prompt_tokens,
            max_tokens=a.max_tokens,
            ignore_eos=True,
            priority=Priority.STANDARD,
            stream=True,
            id=a.id,
            kind=a.kind,
        )
        for i, a in enumerate(arrivals)
    ]


def build_cluster(spec: RunSpec, arrivals: Sequence[Arrival] | None = None) -> VirtualCluster:
    """A ready-to-run cluster for `spec` (its seeded scenario, or `arrivals`)."""
    if arrivals is None:
        arrivals = generate(spec.shape, spec.nodes, spec.duration_s, spec.load, spec.seed)
    return VirtualCluster(virtual_config(spec), request_specs(arrivals))


def to_run_result(spec: RunSpec, result: VirtualResult) -> RunResult:
    """The simulator's records, as the benchmark's scoring code reads them."""
    users = [
        UserRequest(
            o.id, o.kind, o.arrival, o.prompt_tokens, o.max_tokens, spec.client.timeout_s, o.tries
        )
        for o in result.outcomes
    ]
    t = result.engine_totals
    totals = EngineTotals(
        preemptions=t["preemptions"],
        recomputed_tokens=t["recomputed_tokens"],
        zombie_tokens=t["zombie_tokens"],
        generated_tokens=t["generated_tokens"],
    )
    points = result.series
    series: dict[str, list[float]] = {
        "t": [p.t for p in points],
        "kv_usage_max": [p.kv_usage_max for p in points],
        "kv_usage_mean": [p.kv_usage_mean for p in points],
        "running": [float(p.running) for p in points],
        "waiting": [float(p.waiting) for p in points],
        "admitted": [float(p.admissions) for p in points],
        "rejected": [float(p.rejections) for p in points],
        "preemptions": [float(p.preemptions) for p in points],
        "queued": [float(p.queued) for p in points],
    }
    return RunResult(
        policy=spec.label,
        load=spec.load,
        seed=spec.seed,
        preset=spec.preset,
        nodes=spec.nodes,
        duration_s=spec.duration_s,
        warmup_s=spec.warmup_s,
        slo=spec.slo,
        requests=users,
        totals=totals,
        series=series,
        bursts=burst_times(spec.shape.scaled(spec.load), spec.duration_s),
        extra={"policy_overrides": dict(spec.policy_overrides)},
    )


def run_virtual(spec: RunSpec, arrivals: Sequence[Arrival] | None = None) -> RunResult:
    """Run one spec in virtual time (its seeded workload, or `arrivals`); return the records."""
    return to_run_result(spec, build_cluster(spec, arrivals).run())
