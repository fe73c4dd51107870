"""In virtual time: prefix-aware routing finds the cache that headroom-only routing misses,
from kvgate's own placements or from the engines' KV events, without preempting."""

from __future__ import annotations

import dataclasses

import pytest

from kvgate.core.policies.baselines import PolicyName
from kvgate.sim.prefix_workloads import Chats, ChatSpec
from kvgate.sim.presets import GPU_8B
from kvgate.sim.runs import ClientModel, VirtualConfig
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import WorkloadSpec

ENGINE = dataclasses.replace(
    GPU_8B, enable_prefix_caching=True, num_blocks=4000, max_model_len=16_384
)


def _hit_rate(policy: PolicyName, kv_events: bool) -> tuple[float, int, int]:
    chats = Chats(ChatSpec(conversations=40, turns=3, start_window_s=2.0), seed=3)
    config = VirtualConfig(
        engine=ENGINE, workload=WorkloadSpec(), duration_s=300.0, nodes=4, policy=policy,
        client=ClientModel(timeout_s=300.0), kv_events=kv_events, seed=3,
    )  # fmt: skip
    result = VirtualCluster(config, chats.first_turns(), chats).run()
    totals = result.engine_totals
    ok = sum(o.status == "ok" for o in result.outcomes)
    rate = totals["prefix_cache_hits"] / max(1, totals["prefix_cache_queries"])
    return rate, totals["preemptions"], ok


@pytest.mark.parametrize("kv_events", [False, True], ids=["approximate", "kv-events"])
def test_prefix_aware_routing_hits_the_cache_headroom_only_misses(kv_events: bool) -> None:
    blind, _, blind_ok = _hit_rate("headroom-only", False)
    aware, preempted, ok = _hit_rate("prefix-aware", kv_events)
    assert ok == blind_ok == 120
    assert preempted == 0
    # Each turn's history is cached on the engine its last turn went to: 1 time in 4 by
    # chance, every time by prefix.
    assert aware > blind + 0.15, (aware, blind)
