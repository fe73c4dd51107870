"""Shared-prefix workloads (open-loop mixes, closed-loop chats), the ideal hit rate, and
a virtual run of them on prefix-caching engines with their KV events delivered in-process."""

from __future__ import annotations

import dataclasses
from collections import Counter

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.events import BlockRemoved, BlockStored, KVEventBatch
from kvgate.sim.model.prefix import engine_hash, output_ids
from kvgate.sim.prefix_workloads import (
    Chats,
    ChatSpec,
    PrefixMix,
    hot_prefix,
    ideal_hit_rate,
    prefix_mix,
)
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.runs import ClientModel, VirtualConfig
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import WorkloadSpec


def test_a_prefix_mix_shares_its_prefixes_and_is_deterministic() -> None:
    spec = PrefixMix(rate_rps=50, prefixes=3, prefix_tokens=40, suffix_tokens=5, per_tenant=True)
    first = list(prefix_mix(spec, 10.0, seed=3))
    assert first == list(prefix_mix(spec, 10.0, seed=3))
    assert 400 < len(first) < 600
    by_kind: dict[str, set[tuple[int, ...]]] = {}
    for r in first:
        assert r.prompt_ids is not None and len(r.prompt_ids) == r.prompt_tokens == 45
        by_kind.setdefault(r.kind, set()).add(r.prompt_ids[:40])
        assert r.tenant == "t" + r.kind.split("-")[1]
    assert len(by_kind) == 3 and all(len(p) == 1 for p in by_kind.values())


def test_a_hot_prefix_takes_its_share() -> None:
    kinds = Counter(r.kind for r in prefix_mix(hot_prefix(200, prefixes=5), 20.0, seed=1))
    assert abs(kinds["prefix-0"] / sum(kinds.values()) - 0.8) < 0.03
    assert len(kinds) == 5


def test_a_next_turn_is_the_history_plus_the_answer_plus_a_new_message() -> None:
    chats = Chats(ChatSpec(conversations=3, turns=2, system_tokens=20, user_tokens=4), seed=2)
    firsts = chats.first_turns()
    assert [r.arrival for r in firsts] == sorted(r.arrival for r in firsts)
    assert len({r.prompt_ids[:20] for r in firsts if r.prompt_ids}) == 1  # one system prompt
    turn0 = firsts[0]
    assert turn0.prompt_ids is not None
    turn1 = chats.next_turn(turn0, 5.0, 7)
    assert turn1 is not None and turn1.arrival >= 5.0 and turn1.id.endswith("-t1")
    assert turn1.prompt_ids is not None
    assert turn1.prompt_ids[: turn0.prompt_tokens + 7] == turn0.prompt_ids + output_ids(7)
    assert turn1.prompt_tokens == turn0.prompt_tokens + 7 + 4
    assert chats.next_turn(turn1, 9.0, 7) is None  # two turns


def test_the_ideal_hit_rate_reuses_every_earlier_block() -> None:
    a = tuple(range(10))
    b = (*a[:8], 99, 98)
    queries, hits = ideal_hit_rate([(a, 3), (b, 1), (a + output_ids(3), 2)], 4)
    # a leaves 3 full blocks (10 + 2 output tokens computed); b reuses 2 of them; the third
    # request reuses 3 (13 tokens: 3 blocks at most, its last token being computed).
    assert (queries, hits) == (10 + 10 + 13, 0 + 8 + 12)


def test_chats_run_to_their_last_turn_on_caching_engines_and_publish_their_events() -> None:
    engine = dataclasses.replace(CPU_TINY, enable_prefix_caching=True)
    spec = ChatSpec(conversations=12, turns=3, system_tokens=300, user_tokens=50,
                    output_tokens=40, think_s=0.2, start_window_s=1.0)  # fmt: skip
    chats = Chats(spec, seed=4)
    batches: dict[str, list[KVEventBatch]] = {}
    config = VirtualConfig(
        engine=engine, workload=WorkloadSpec(), duration_s=120.0, nodes=2,
        policy="round-robin", client=ClientModel(timeout_s=60.0), kv_events=True,
    )  # fmt: skip
    cluster = VirtualCluster(
        config, chats.first_turns(), chats, lambda n, b: batches.setdefault(n, []).append(b)
    )
    result = cluster.run()
    assert len(result.outcomes) == 36 and all(o.status == "ok" for o in result.outcomes)
    by_id = {o.id: o for o in result.outcomes}
    for o in result.outcomes:
        conv, turn = o.id.split("-t")
        if turn != "0":
            before = by_id[f"{conv}-t{int(turn) - 1}"]
            assert before.completed_at is not None and o.arrival >= before.completed_at
    totals = result.engine_totals
    assert totals["prefix_cache_hits"] > 0.5 * totals["prefix_cache_queries"]
    assert set(batches) == {"node-0", "node-1"}
    for node, got in batches.items():
        assert [b.seq for b in got] == list(range(len(got)))
        assert [b.ts for b in got] == sorted(b.ts for b in got)
        cached: set[bytes | int] = set()
        for batch in got:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert len(event.token_ids) == len(event.block_hashes) * engine.block_size
                    cached.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    cached.difference_update(event.block_hashes)
        i = int(node.split("-")[1])
        engine_cache = cluster.engines[i]._sched.cache
        assert engine_cache is not None
        assert cached == {engine_hash(h) for h in engine_cache.refs}
    # Every turn's system prompt blocks were stored once per engine at most.
    system = block_hashes(chats.issued["c0-t0"].prompt_ids or (), engine.block_size)[:9]
    assert all(engine_hash(h) in {e for n in batches for b in batches[n] for ev in b.events
                                  if isinstance(ev, BlockStored) for e in ev.block_hashes}
               for h in system)  # fmt: skip
