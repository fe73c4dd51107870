"""kvgate's policies against simulated paged-KV engines at 3x their sustainable load.

Virtual time (`kvgate.sim.virtual`, via `kvgate.bench.virtual`): the engine simulator with
vLLM-style scheduling and recompute preemption, scraped every 50 ms with 10 ms delivery lag,
clients that time out, retry and honour Retry-After. The same seeded workload goes through
`none`, `adaptive-fixed` (the planned peak held under the watermarks) and `adaptive` (the
ceiling set by what the engine measures), with the gateway's queue, as `kvgate serve` runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.bench.metrics import RunResult, summarize
from kvgate.bench.profiles import get_profile
from kvgate.bench.suite import RunSpec
from kvgate.bench.virtual import build_cluster, to_run_result
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.request import Priority
from kvgate.sim.virtual import VirtualCluster


def _cluster(
    policy: str, seed: int, preset: str = "cpu-tiny", duration_s: float = 30.0
) -> tuple[dict[str, Any], VirtualCluster, RunResult]:
    """Two `preset` engines at 3x the profile's mix for `duration_s`; the run's summary,
    the cluster as it ended and its records."""
    prof = get_profile(preset)
    spec = RunSpec(
        preset=preset,
        nodes=2,
        shape=prof.shape,
        load=3.0,
        seed=seed,
        duration_s=duration_s,
        warmup_s=5.0,
        client=prof.client,
        slo=prof.slo,
        label=policy,
        policy=policy,
    )
    cluster = build_cluster(spec)
    result = to_run_result(spec, cluster.run())
    return summarize(result), cluster, result


def _run(policy: str, seed: int) -> tuple[dict[str, Any], float, float]:
    summary, _, result = _cluster(policy, seed)
    return summary, max(result.series["kv_usage_max"]), max(result.series["queued"])


@pytest.mark.parametrize("seed", [4, 5])
def test_the_fixed_ceiling_prevents_the_preemption_that_no_admission_suffers(seed: int) -> None:
    unprotected, unprotected_peak, _ = _run("none", seed)
    protected, protected_peak, most_queued = _run("adaptive-fixed", seed)
    assert unprotected["preemptions"] > 0 and unprotected_peak == 1.0
    assert protected["preemptions"] == 0
    assert protected_peak <= 0.92
    # The excess waited in the gateway instead of in the engines' KV caches.
    assert most_queued > 0 and protected["errors"] == 0
    assert protected["completed"] == protected["user_requests"]
    assert protected["slo_attainment"] > unprotected["slo_attainment"]


SEEDS = (4, 5, 6, 7, 8, 9)


def test_where_preemption_is_cheap_the_measured_ceiling_serves_as_well_as_the_fixed() -> None:
    """`cpu-tiny` recomputes a preempted request in milliseconds: the measured ceiling
    plans its nodes above the cache, lets the engine preempt now and then (the engine's
    business) and serves users, over six seeds, at least as well as the fixed ceiling and
    far better than no admission, with a fraction of the recomputation."""
    slo = {"none": 0.0, "adaptive-fixed": 0.0, "adaptive": 0.0}
    recomputed = {"none": 0, "adaptive": 0}
    for seed in SEEDS:
        runs = {policy: _run(policy, seed) for policy in slo}
        measured, _, most_queued = runs["adaptive"]
        assert most_queued > 0 and measured["errors"] == 0
        assert measured["completed"] == measured["user_requests"]
        assert measured["slo_attainment"] > runs["none"][0]["slo_attainment"]
        for policy, (summary, _, _) in runs.items():
            slo[policy] += summary["slo_attainment"] / len(SEEDS)
        for policy in recomputed:
            recomputed[policy] += runs[policy][0]["recomputed_tokens"]
    assert slo["adaptive"] >= slo["adaptive-fixed"] > slo["none"]
    assert 0 < recomputed["adaptive"] * 3 < recomputed["none"]


def test_the_controller_chooses_by_what_preemption_costs_on_each_preset() -> None:
    """The same policy, the same rule: on `cpu-tiny` a long request is cheap to recompute
    (milliseconds against its decode) and the nodes run above their cache; on `gpu-8b` a
    92-129k-token prompt costs seconds of prefill to recompute, so long requests stay
    under the watermarks and the engines never preempt."""
    cpu, cpu_cluster, cpu_result = _cluster("adaptive", 4)
    gpu, gpu_cluster, _ = _cluster("adaptive", 1, "gpu-8b", duration_s=60.0)
    assert cpu["preemptions"] > 0 and max(cpu_result.series["kv_usage_max"]) > 0.92
    assert gpu["preemptions"] == 0
    for cluster, preset, cheap_long in (
        (cpu_cluster, "cpu-tiny", True),
        (gpu_cluster, "gpu-8b", False),
    ):
        policy = cluster.policies[0].policy
        assert isinstance(policy, AdaptivePolicy)
        kv = get_profile(preset).shape.kv_capacity_tokens
        long_prompt = int(0.35 * kv)
        for node_id in cluster.node_ids:
            meter = policy.ceilings.snapshot(node_id, cluster.clock.now())
            assert meter is not None and meter["measured"]["prefill_measured"]
            assert policy.ceilings.is_cheap(node_id, 50, 150)  # a chat, on both
            assert policy.ceilings.is_cheap(node_id, long_prompt, 300) is cheap_long
            node = policy.nodes[node_id]
            over = policy.ceiling(node, Priority.STANDARD, cheap=cheap_long)
            assert (over > 1.0) is cheap_long
