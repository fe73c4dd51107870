"""The engine model's prefix cache: reuse, blocks shared and counted once, LRU eviction of
free cached blocks, vLLM's hit counters, prefill time only for what is not cached, and
the KV events of each step."""

from __future__ import annotations

import dataclasses

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvgate.sim.model.engine import Engine, EngineConfig, StepLatency
from kvgate.sim.model.prefix import engine_hash, output_ids

LAT = StepLatency(fixed_s=0.01, per_prefill_token_s=0.001, per_seq_s=0.0, per_context_token_s=0)


def config(num_blocks: int = 9, **kw: object) -> EngineConfig:
    base = dict(
        num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=32, latency=LAT, enable_prefix_caching=True,
    )  # fmt: skip
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def run(engine: Engine, now: float = 0.0) -> tuple[float, list]:
    events = []
    while (result := engine.step(now)) is not None:
        now = result.end
        events += result.kv_events
        assert engine.blocks_in_use() == engine.used_blocks
    return now, events


PREFIX = tuple(range(100, 112))  # three full blocks


def test_a_cached_prefix_is_not_prefilled_again() -> None:
    engine = Engine(config(), record_kv_events=True)
    engine.add_request("a", 14, 2, 0.0, ignore_eos=True, prompt_ids=(*PREFIX, 1, 2))
    first = engine.step(0.0)
    assert first is not None and first.duration == LAT.duration(14, 1, 0)
    now, _ = run(engine, first.end)
    assert engine.used_blocks == 0 and engine.kv_usage == 0.0  # cached blocks count as free
    engine.add_request("b", 14, 2, now, ignore_eos=True, prompt_ids=(*PREFIX, 3, 4))
    second = engine.step(now)
    assert second is not None
    # 12 tokens cached: only the last 2 are computed (attending to the 12 cached ones).
    assert second.duration == LAT.duration(2, 1, 12)
    snap = engine.metrics_snapshot()
    assert (snap.prefix_cache_queries_total, snap.prefix_cache_hits_total) == (28, 12)


def test_the_last_token_is_always_computed() -> None:
    engine = Engine(config())
    engine.add_request("a", 12, 1, 0.0, prompt_ids=PREFIX)
    now, _ = run(engine)
    engine.add_request("b", 12, 1, now, prompt_ids=PREFIX)  # the same prompt, all full
    result = engine.step(now)
    assert result is not None and result.duration == LAT.duration(4, 1, 8)
    assert engine.prefix_cache_hits_total == 8


def test_a_block_held_by_several_requests_counts_once() -> None:
    engine = Engine(config(num_blocks=17))
    for i in range(3):
        engine.add_request(f"r{i}", 14, 6, 0.0, ignore_eos=True, prompt_ids=(*PREFIX, i, i))
    engine.step(0.0)
    # 3 shared prefix blocks + one private block each (tokens 13-14), not 3 x 4.
    assert engine.used_blocks == 3 + 3 == engine.blocks_in_use()
    assert engine.blocks_held() == {"r0": 4, "r1": 4, "r2": 4}
    assert engine.kv_usage == 6 / 16
    run(engine)
    assert engine.used_blocks == 0


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    # 8 usable blocks. Two 8-token prompts leave 2 + 2 cached blocks (plus output ones).
    engine = Engine(config(), record_kv_events=True)
    a, b = tuple(range(200, 208)), tuple(range(300, 308))
    engine.add_request("a", 8, 1, 0.0, prompt_ids=a)
    now, _ = run(engine)
    engine.add_request("b", 8, 1, now, prompt_ids=b)
    now, _ = run(engine, now)
    cached_a, cached_b = block_hashes(a, 4), block_hashes(b, 4)
    cache = engine._sched.cache
    assert cache is not None and list(cache.lru) == [*reversed(cached_a), *reversed(cached_b)]
    # A 24-token prompt needs 6 blocks: the 4 never-cached ones, then a's two (a's tail first).
    engine.add_request("c", 24, 1, now, prompt_ids=tuple(range(400, 424)))
    result = engine.step(now)
    assert result is not None
    removed = [h for e in result.kv_events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [engine_hash(h) for h in reversed(cached_a)]
    assert list(cache.lru)[:2] == list(reversed(cached_b))  # then c's, as c ended too
    # A cached block being reused is taken out of the free list, not evicted.
    engine.add_request("d", 9, 1, result.end, prompt_ids=(*b, 7))
    run(engine, result.end)
    assert engine.prefix_cache_hits_total == 8


def test_stored_events_carry_the_blocks_tokens_and_their_parent() -> None:
    engine = Engine(config(), record_kv_events=True)
    engine.add_request("a", 14, 3, 0.0, ignore_eos=True, prompt_ids=(*PREFIX, 1, 2))
    _, events = run(engine)
    stored = [e for e in events if isinstance(e, BlockStored)]
    prompt = stored[0]
    hashes = block_hashes((*PREFIX, 1, 2, *output_ids(3)), 4)
    assert prompt.block_hashes == tuple(engine_hash(h) for h in hashes[:3])
    assert prompt.parent_block_hash is None and prompt.token_ids == PREFIX
    assert prompt.block_size == 4
    # The block that the output filled (tokens 13-16) enters the cache when the request ends.
    (output,) = stored[1:]
    assert output.parent_block_hash == engine_hash(hashes[2])
    assert output.token_ids == (1, 2, *output_ids(2))
    assert output.block_hashes == (engine_hash(hashes[3]),)


def test_a_next_turn_reuses_the_previous_answer() -> None:
    engine = Engine(config(num_blocks=17))
    engine.add_request("t1", 10, 8, 0.0, ignore_eos=True, prompt_ids=PREFIX[:10])
    now, _ = run(engine)
    turn2 = (*PREFIX[:10], *output_ids(8), 50, 51, 52, 53)
    engine.add_request("t2", len(turn2), 2, now, ignore_eos=True, prompt_ids=turn2)
    run(engine, now)
    # tokens 1-16 of turn 2 (prompt 10 + 7 output tokens computed) were cached.
    assert engine.prefix_cache_hits_total == 16


def test_prompts_without_ids_share_nothing_and_caching_off_changes_nothing() -> None:
    engine = Engine(config())
    engine.add_request("a", 12, 1, 0.0)
    now, _ = run(engine)
    engine.add_request("b", 12, 1, now)
    run(engine, now)
    assert engine.prefix_cache_hits_total == 0 and engine.prefix_cache_queries_total == 24
    plain = Engine(dataclasses.replace(config(), enable_prefix_caching=False))
    plain.add_request("a", 12, 1, 0.0, prompt_ids=PREFIX)
    now, events = run(plain)
    plain.add_request("b", 12, 1, now, prompt_ids=PREFIX)
    result = plain.step(now)
    assert result is not None and result.duration == LAT.duration(12, 1, 0)
    assert events == [] and plain.prefix_cache_queries_total == 0


def test_preempted_requests_find_their_blocks_again_and_are_counted_apart() -> None:
    # 4 usable blocks: two 7-token prompts with 9 output tokens each cannot both finish.
    engine = Engine(config(num_blocks=5, max_model_len=16))
    engine.add_request("a", 7, 9, 0.0, ignore_eos=True, prompt_ids=tuple(range(7)))
    engine.add_request("b", 7, 9, 0.0, ignore_eos=True, prompt_ids=tuple(range(50, 57)))
    run(engine)
    snap = engine.metrics_snapshot()
    assert snap.preemptions_evicted >= 1
    assert snap.prefix_cache_queries_total == 14  # re-admissions are not queries
    assert snap.recomputed_tokens_total < 9 * snap.preemptions_evicted


def test_reset_clears_the_cache_only_when_nothing_is_held() -> None:
    engine = Engine(config(), record_kv_events=True)
    engine.add_request("a", 12, 3, 0.0, prompt_ids=PREFIX)
    engine.step(0.0)
    assert not engine.reset_prefix_cache()
    run(engine, 1.0)
    assert engine.reset_prefix_cache()
    assert engine.take_kv_events() == [AllBlocksCleared()]
    engine.add_request("b", 12, 1, 2.0, prompt_ids=PREFIX)
    run(engine, 2.0)
    assert engine.prefix_cache_hits_total == 0
    assert not Engine(
        dataclasses.replace(config(), enable_prefix_caching=False)
    ).reset_prefix_cache()
