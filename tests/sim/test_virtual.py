"""Virtual-time runs: deterministic for a seed, and the cluster behaves like one."""

from __future__ import annotations

import dataclasses

from kvgate.sim.presets import CPU_TINY
from kvgate.sim.runs import VirtualConfig, VirtualResult, read_timeout_client
from kvgate.sim.virtual import run_virtual
from kvgate.sim.workload import WorkloadSpec, estimate_capacity_rps, generate

WORKLOAD = WorkloadSpec(prompt_mean=300, max_tokens_mean=200, ignore_eos_fraction=0.3)


def config(policy: str, seed: int = 1, **kw: object) -> VirtualConfig:
    rate = 3.0 * estimate_capacity_rps(CPU_TINY, WORKLOAD, nodes=2)
    base = dict(
        engine=CPU_TINY,
        workload=dataclasses.replace(WORKLOAD, rate_rps=rate),
        duration_s=10.0,
        nodes=2,
        gateways=2,
        policy=policy,  # type: ignore[arg-type]
        # A streaming client's read timeout per token, one backed-off retry, five 429s.
        client=read_timeout_client(timeout_s=5.0, max_retries=1),
        seed=seed,
    )
    base.update(kw)
    return VirtualConfig(**base)  # type: ignore[arg-type]


def fingerprint(result: VirtualResult) -> tuple:
    outcomes = (
        tuple(
            (
                o.index,
                o.status,
                o.attempts,
                o.rejections_429,
                o.timeouts,
                o.first_token_at,
                o.completed_at,
                o.output_tokens,
                o.zombie_tokens,
                o.node,
                tuple((a.outcome, a.start, a.end, a.output_tokens) for a in o.tries),
            )
            for o in result.outcomes
        ),
    )
    series = tuple(
        (p.t, p.kv_usage_mean, p.running, p.waiting, p.admissions) for p in result.series
    )
    return outcomes, series, tuple(sorted(result.engine_totals.items()))


def test_runs_are_deterministic_for_a_seed() -> None:
    for policy in ("none", "adaptive"):
        a = run_virtual(config(policy))
        b = run_virtual(config(policy))
        assert fingerprint(a) == fingerprint(b), policy
        c = run_virtual(config(policy, seed=2))
        assert fingerprint(a) != fingerprint(c), policy


def test_overload_without_admission_times_out_and_leaves_zombies() -> None:
    cfg = config("none", engine=dataclasses.replace(CPU_TINY, abort_on_disconnect=False))
    result = run_virtual(cfg)
    summary = result.summary()
    assert summary["timeouts"] > 0
    assert summary["zombie_tokens"] > 0
    assert sum(o.zombie_tokens for o in result.outcomes) > 0
    assert summary["by_status"].get("ok", 0) > 0
    assert len(result.series) == 10
    assert max(p.kv_usage_max for p in result.series) > 0.9


def test_adaptive_admission_sheds_with_429_and_keeps_kv_below_panic() -> None:
    result = run_virtual(config("adaptive"))
    summary = result.summary()
    assert summary["rejections_429"] > 0
    assert summary["by_status"].get("ok", 0) > 0
    late = [p for p in result.series if p.t > 3]
    assert max(p.kv_usage_max for p in late) <= 1.0
    assert summary["preemptions"] <= run_virtual(config("none")).summary()["preemptions"]


def test_workload_is_deterministic_and_within_model_limits() -> None:
    a = list(generate(WORKLOAD, 50.0, 3, 2048))
    b = list(generate(WORKLOAD, 50.0, 3, 2048))
    assert a == b and len(a) > 300
    assert all(r.prompt_tokens + r.max_tokens < 2048 for r in a)
    assert all(0 <= r.arrival < 50 for r in a)
