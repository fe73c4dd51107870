"""The engine model's bookkeeping: blocks, preemption, recompute, aborts, zombies."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.sim.model.engine import Engine, EngineConfig, EngineError, StepLatency
from kvgate.sim.presets import CPU_TINY

LAT = StepLatency(fixed_s=0.01, per_prefill_token_s=0.001, per_seq_s=0.001, per_context_token_s=0)


def small(**kw: object) -> EngineConfig:
    base = dict(
        num_blocks=5,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=16,
        latency=LAT,
    )
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def check_invariants(engine: Engine) -> None:
    held = engine.blocks_held()
    assert all(b >= 0 for b in held.values())
    assert sum(held.values()) == engine.used_blocks
    assert 0 <= engine.used_blocks <= engine.config.usable_blocks
    assert engine.num_running <= engine.config.max_num_seqs
    assert engine.num_waiting >= 0


def drain(engine: Engine, now: float, limit: int = 10_000) -> float:
    for _ in range(limit):
        result = engine.step(now)
        if result is None:
            return now
        now = result.end
        check_invariants(engine)
    raise AssertionError("engine did not drain")


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 12), st.integers(1, 8), st.booleans(), st.integers(0, 2)
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("disconnect"), st.integers(0, 30)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    scheduling=st.sampled_from(["fcfs", "priority"]),
    abort_on_disconnect=st.booleans(),
    chunked=st.booleans(),
)
def test_block_accounting_never_negative_or_leaked(
    ops: list[tuple], scheduling: str, abort_on_disconnect: bool, chunked: bool
) -> None:
    cfg = small(
        scheduling=scheduling,
        abort_on_disconnect=abort_on_disconnect,
        enable_chunked_prefill=chunked,
        eos_mean_tokens=3.0,
    )
    engine = Engine(cfg, seed=1)
    now, added, finished, aborted = 0.0, 0, set(), set()
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, ignore_eos, prio = op
            try:
                engine.add_request(
                    f"r{added}", prompt, max_tokens, now, ignore_eos=ignore_eos, priority=prio
                )
            except EngineError:
                assert prompt + max_tokens > cfg.max_model_len
            else:
                added += 1
        elif op[0] == "step":
            result = engine.step(now)
            if result is not None:
                now = result.end
                for f in result.finished:
                    finished.add(f.request_id)
                    assert 1 <= f.output_tokens
                    assert f.reason == "length" or f.output_tokens < 99
                aborted.update(result.aborted)
        elif op[0] == "abort":
            engine.abort(f"r{op[1]}")
        else:
            engine.disconnect(f"r{op[1]}")
        check_invariants(engine)
    while engine.has_work:
        result = engine.step(now)
        if result is None:
            break
        now = result.end
        finished.update(f.request_id for f in result.finished)
        aborted.update(result.aborted)
        check_invariants(engine)
    assert engine.used_blocks == 0
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert finished.isdisjoint(aborted)
    assert len(finished) + len(aborted) == added


def test_preemption_exactly_when_blocks_run_out_and_recompute_refills() -> None:
    # 4 usable blocks of 4 tokens. Two 7-token prompts take 2 blocks each; the 9th token
    # of each needs a third block, which only one of them can get.
    engine = Engine(small(max_model_len=16), seed=0)
    engine.add_request("a", 7, 9, 0.0, ignore_eos=True)
    engine.add_request("b", 7, 9, 0.0, ignore_eos=True)
    r1 = engine.step(0.0)
    assert r1 is not None and sorted(r1.first_tokens) == ["a", "b"]
    assert engine.used_blocks == 4 and r1.preempted == []
    r2 = engine.step(r1.end)  # slot 8 still fits in the second block
    assert r2 is not None and r2.preempted == [] and engine.used_blocks == 4
    r3 = engine.step(r2.end)  # slot 9 needs a new block each: the newest is preempted
    assert r3 is not None and r3.preempted == ["b"]
    assert engine.blocks_held() == {"a": 3}
    assert engine.num_waiting == 1 and engine.output_tokens("b") == 2
    # vLLM counts the preemption only when b produces its next token.
    assert engine.metrics_snapshot().preemptions_total == 0
    assert engine.metrics_snapshot().preemptions_evicted == 1
    now, b_back = r3.end, False
    for _ in range(100):
        result = engine.step(now)
        if result is None:
            break
        now = result.end
        check_invariants(engine)
        if "b" in result.emitted or any(f.request_id == "b" for f in result.finished):
            b_back = True
        if "a" in engine and engine.output_tokens("b") == 2:
            assert engine.num_waiting == 1  # b cannot fit beside a
    snap = engine.metrics_snapshot()
    assert not b_back or snap.preemptions_total == 1
    assert snap.preemptions_total == 1
    # b had computed 8 tokens (7 prompt + 1 generated) before its blocks were freed.
    assert snap.recomputed_tokens_total == 8
    assert snap.generation_tokens_total == 18
    assert snap.success_total["length"] == 2


def test_resumed_request_reprefills_prompt_and_generated_tokens() -> None:
    engine = Engine(small(), seed=0)
    engine.add_request("a", 7, 9, 0.0, ignore_eos=True)
    engine.add_request("b", 7, 9, 0.0, ignore_eos=True)
    now = 0.0
    iteration_tokens: list[int] = []
    for _ in range(200):
        before = engine.iteration_tokens.sum
        result = engine.step(now)
        if result is None:
            break
        now = result.end
        iteration_tokens.append(int(engine.iteration_tokens.sum - before))
    # The resumed b is re-prefilled as one chunk of 7 prompt + 2 generated tokens.
    assert 9 in iteration_tokens


def test_abort_frees_blocks_at_the_next_step() -> None:
    engine = Engine(CPU_TINY, seed=0)
    engine.add_request("x", 100, 50, 0.0, ignore_eos=True)
    engine.add_request("y", 10, 5, 0.0, ignore_eos=True)
    result = engine.step(0.0)
    assert result is not None
    assert engine.blocks_held()["x"] == 4
    assert engine.abort("x")
    assert engine.blocks_held()["x"] == 4  # nothing happens before the next step
    result = engine.step(result.end)
    assert result is not None and result.aborted == ["x"]
    assert "x" not in engine and engine.blocks_held() == {"y": 1}
    assert engine.abort("x") is False
    assert engine.metrics_snapshot().success_total["abort"] == 0  # as in vLLM


def test_abort_of_a_waiting_request() -> None:
    engine = Engine(dataclasses.replace(CPU_TINY, max_num_seqs=1), seed=0)
    engine.add_request("x", 10, 50, 0.0, ignore_eos=True)
    engine.add_request("y", 10, 50, 0.0, ignore_eos=True)
    result = engine.step(0.0)
    assert result is not None and engine.num_waiting == 1
    engine.abort("y")
    engine.step(result.end)
    assert engine.num_waiting == 0 and "y" not in engine


def test_disconnect_without_abort_leaves_a_zombie_that_runs_to_completion() -> None:
    cfg = dataclasses.replace(CPU_TINY, abort_on_disconnect=False)
    engine = Engine(cfg, seed=0)
    engine.add_request("z", 10, 40, 0.0, ignore_eos=True)
    now = 0.0
    for _ in range(10):
        result = engine.step(now)
        assert result is not None
        now = result.end
    assert engine.output_tokens("z") == 10
    engine.disconnect("z")
    finished = []
    while engine.has_work:
        result = engine.step(now)
        assert result is not None
        now = result.end
        finished += result.finished
    assert [f.output_tokens for f in finished] == [40]
    assert finished[0].zombie_tokens == 30 and finished[0].client_gone
    assert engine.metrics_snapshot().zombie_tokens_total == 30


def test_disconnect_with_abort_costs_at_most_the_in_flight_token() -> None:
    engine = Engine(CPU_TINY, seed=0)
    engine.add_request("z", 10, 40, 0.0, ignore_eos=True)
    engine.step(0.0)
    duration = engine.begin_step(1.0)
    assert duration is not None
    engine.disconnect("z")  # while the step is in flight
    engine.finish_step()
    assert engine.metrics_snapshot().zombie_tokens_total == 1
    engine.step(2.0)
    assert "z" not in engine and engine.used_blocks == 0


def test_eos_sampling_ends_early_and_ignore_eos_does_not() -> None:
    engine = Engine(dataclasses.replace(CPU_TINY, eos_mean_tokens=20), seed=3)
    for i in range(20):
        engine.add_request(f"s{i}", 20, 200, 0.0)
    engine.add_request("full", 20, 200, 0.0, ignore_eos=True)
    now, finished = 0.0, {}
    while engine.has_work:
        result = engine.step(now)
        assert result is not None
        now = result.end
        finished.update({f.request_id: f for f in result.finished})
    assert finished["full"].output_tokens == 200 and finished["full"].reason == "length"
    stops = [f for k, f in finished.items() if k != "full"]
    assert all(f.reason == "stop" and f.output_tokens < 200 for f in stops)
    assert 5 < sum(f.output_tokens for f in stops) / len(stops) < 60


def test_bad_requests_are_refused() -> None:
    engine = Engine(CPU_TINY)
    with pytest.raises(EngineError):
        engine.add_request("a", 2048, 1, 0.0)
    with pytest.raises(EngineError):
        engine.add_request("a", 1000, 1049, 0.0)
    with pytest.raises(EngineError):
        engine.add_request("a", 0, 1, 0.0)
    engine.add_request("a", 10, None, 0.0)  # max_tokens defaults to what is left
    with pytest.raises(EngineError):
        engine.add_request("a", 10, 10, 0.0)


def test_step_latency_grows_with_batch() -> None:
    engine = Engine(CPU_TINY)
    engine.add_request("one", 10, 100, 0.0, ignore_eos=True)
    engine.step(0.0)
    single = engine.step(1.0)
    assert single is not None and 0.003 <= single.duration <= 0.004
    for i in range(31):
        engine.add_request(f"m{i}", 10, 100, 2.0, ignore_eos=True)
    engine.step(2.0)
    many = engine.step(3.0)
    assert many is not None
    assert 32 / many.duration == pytest.approx(2150, rel=0.15)
