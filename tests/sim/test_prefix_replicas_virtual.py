"""In virtual time: replicas that subscribe to the same engines' KV events route a prefix to
the same engine, whichever replica a request reaches; replicas that know only their own
placements cannot."""

from __future__ import annotations

import dataclasses

from kvgate.bench.prefix import turn_moves
from kvgate.cluster.sync import SYNC_PERIOD_S
from kvgate.sim.kv_fanout import KVEventsVia
from kvgate.sim.prefix_workloads import Chats, ChatSpec
from kvgate.sim.presets import GPU_8B
from kvgate.sim.runs import ClientModel, VirtualConfig, VirtualResult
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import WorkloadSpec

ENGINE = dataclasses.replace(
    GPU_8B, enable_prefix_caching=True, num_blocks=4000, max_model_len=16_384
)


def _run(replicas: int, kv_events: bool, via: KVEventsVia = "subscribe") -> VirtualResult:
    chats = Chats(ChatSpec(conversations=40, turns=3, start_window_s=2.0), seed=3)
    config = VirtualConfig(
        engine=ENGINE, workload=WorkloadSpec(), duration_s=120.0, nodes=4, gateways=replicas,
        policy="prefix-aware", client=ClientModel(timeout_s=300.0), kv_events=kv_events,
        kv_events_via=via, sync_interval_s=SYNC_PERIOD_S if replicas > 1 else None, seed=3,
    )  # fmt: skip
    return VirtualCluster(config, chats.first_turns(), chats).run()


def _hit_rate(result: VirtualResult) -> float:
    totals = result.engine_totals
    return totals["prefix_cache_hits"] / max(1, totals["prefix_cache_queries"])


def test_two_subscribed_replicas_send_a_prefix_where_one_replica_would() -> None:
    one = _run(1, kv_events=True)
    two = _run(2, kv_events=True)
    assert sum(o.status == "ok" for o in two.outcomes) == 120
    moves = turn_moves(two)
    # A turn's history is cached where its previous turn ran; the other replica learned
    # that from the engine's events and sends the turn there too.
    assert moves["pairs_across"] >= 30
    assert moves["moved_across"] == 0.0, moves
    assert _hit_rate(two) >= _hit_rate(one) - 0.01, (_hit_rate(two), _hit_rate(one))


def test_replicas_that_learn_the_events_through_the_owners_view_route_alike() -> None:
    # Think times (1 s) are long against the one or two sync intervals a view adds.
    two = _run(2, kv_events=True, via="views")
    assert turn_moves(two)["moved_across"] == 0.0
    assert _hit_rate(two) >= _hit_rate(_run(1, kv_events=True)) - 0.01


def test_approximate_replicas_do_not_know_where_the_other_sent_a_prefix() -> None:
    # Each replica's index holds only its own placements: a turn the other replica placed
    # goes where this one last saw the conversation, or where the system prompt is.
    two = _run(2, kv_events=False)
    moves = turn_moves(two)
    assert moves["moved_across"] > 0.5, moves
    assert moves["moved_within"] < 0.2, moves
    assert _hit_rate(two) < _hit_rate(_run(1, kv_events=False)) - 0.05
