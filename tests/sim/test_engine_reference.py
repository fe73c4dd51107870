"""The fast engine against a naive, per-sequence transcription of vLLM's scheduler.

`kvgate.sim.model.engine` keeps decoding sequences in aggregate form and preempts in O(victims);
this reference walks every sequence every step, exactly in vLLM's order (running list
first, preempting from its tail until the current sequence's new blocks fit, then waiting
requests only if nobody was preempted). Random operation sequences must give identical
steps: durations, tokens, first tokens, finishes, preemptions and block counts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvgate.sim.model.engine import Engine, EngineConfig, StepLatency

LAT = StepLatency(fixed_s=0.01, per_prefill_token_s=1e-4, per_seq_s=1e-3, per_context_token_s=1e-6)


@dataclass
class RefSeq:
    rid: str
    prompt: int
    target: int
    max_tokens: int
    priority: int
    arrival: float
    order: int
    computed: int = 0
    generated: int = 0
    prefilled: bool = False  # prompt (+ generated, after a preemption) fully computed


class Reference:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.free = cfg.usable_blocks
        self.running: list[RefSeq] = []
        self.waiting: deque[RefSeq] = deque()
        self.pending: list[str] = []

    def ceil(self, n: int) -> int:
        return -(-n // self.bs)

    def add(self, seq: RefSeq) -> None:
        self.waiting.append(seq)
        self._sort_waiting()

    def _sort_waiting(self) -> None:
        if self.cfg.scheduling == "priority":  # vLLM's heap on (priority, arrival)
            self.waiting = deque(
                sorted(self.waiting, key=lambda s: (s.priority, s.arrival, s.order))
            )

    def abort(self, rid: str) -> None:
        self.pending.append(rid)

    def step(self) -> dict | None:
        for rid in self.pending:
            for seq in self.running:
                if seq.rid == rid:
                    self.running.remove(seq)
                    self.free += self.ceil(seq.computed)
            self.waiting = deque(s for s in self.waiting if s.rid != rid)
        self.pending = []
        if not self.running and not self.waiting:
            return None
        decoding = [s for s in self.running if s.prefilled]
        budget = self.cfg.max_num_batched_tokens - len(decoding)
        chunks: dict[str, int] = {}
        taken: dict[str, int] = {}  # blocks allocated this step, per scheduled sequence
        preempted: list[str] = []
        scheduled: list[RefSeq] = []
        by_priority = self.cfg.scheduling == "priority"
        i = 0
        while i < len(self.running):  # vLLM's walk over the running list
            seq = self.running[i]
            if seq.prefilled:
                new = 1
            else:
                new = min(seq.prompt + seq.generated - seq.computed, budget)
                if new <= 0:
                    i += 1
                    continue
            need = self.ceil(seq.computed + new) - self.ceil(seq.computed)
            while need > self.free:
                if by_priority:
                    victim = max(self.running, key=lambda s: (s.priority, s.arrival))
                    index = self.running.index(victim)
                    del self.running[index]
                    if index < i:
                        i -= 1
                else:
                    victim = self.running.pop()
                if victim in scheduled:  # only in priority mode: undo its allocation
                    scheduled.remove(victim)
                    self.free += taken.pop(victim.rid)
                    if not victim.prefilled:
                        budget += chunks.pop(victim.rid)
                self.free += self.ceil(victim.computed)
                victim.computed, victim.prefilled = 0, False
                self.waiting.appendleft(victim)
                self._sort_waiting()
                preempted.append(victim.rid)
                if victim is seq:
                    break
            if seq not in self.running:
                continue  # preempted itself (the simulator goes on with the rest)
            self.free -= need
            taken[seq.rid] = need
            if not seq.prefilled:
                chunks[seq.rid] = new
                budget -= new
            scheduled.append(seq)
            i += 1
        budget = self.cfg.max_num_batched_tokens - sum(
            1 if s.prefilled else chunks[s.rid] for s in scheduled
        )
        if not preempted:
            while budget > 0 and self.waiting and len(self.running) < self.cfg.max_num_seqs:
                seq = self.waiting[0]
                chunk = min(seq.prompt + seq.generated, budget)
                if self.ceil(chunk) > self.free:
                    break
                self.waiting.popleft()
                self.running.append(seq)
                self.free -= self.ceil(chunk)
                chunks[seq.rid] = chunk
                budget -= chunk
                scheduled.append(seq)
        prefill = sum(chunks[s.rid] for s in scheduled if not s.prefilled)
        n_dec = sum(1 for s in scheduled if s.prefilled)
        context = sum(s.computed for s in scheduled)
        duration = LAT.duration(prefill, n_dec + (len(scheduled) - n_dec), context)
        emitted, finished = [], []
        for seq in scheduled:
            if seq.prefilled:
                seq.computed += 1
                seq.generated += 1
                emitted.append(seq.rid)
            else:
                seq.computed += chunks[seq.rid]
                if seq.computed == seq.prompt + seq.generated:
                    seq.generated += 1
                    seq.prefilled = True
                    emitted.append(seq.rid)
        for seq in list(self.running):
            if seq.prefilled and seq.generated >= seq.target:
                self.running.remove(seq)
                self.free += self.ceil(seq.prompt + seq.generated - 1)
                finished.append(seq.rid)
        return {
            "duration": duration,
            "emitted": sorted(emitted),
            "finished": sorted(finished),
            "preempted": preempted,
            "used": self.cfg.usable_blocks - self.free,
            "running": [s.rid for s in self.running],
        }


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 14), st.integers(1, 10), st.integers(0, 2)),
        st.tuples(st.just("add"), st.integers(4, 10), st.integers(4, 10), st.integers(0, 2)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 25)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(5, 8),
    budget=st.sampled_from([4, 8, 16, 64]),
    scheduling=st.sampled_from(["fcfs", "priority"]),
)
def test_fast_engine_matches_the_naive_vllm_walk(
    ops: list[tuple], num_blocks: int, budget: int, scheduling: str
) -> None:
    cfg = EngineConfig(
        num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
        max_model_len=16, latency=LAT, eos_mean_tokens=4.0, scheduling=scheduling,
    )  # type: ignore[arg-type]  # fmt: skip
    engine, ref = Engine(cfg, seed=5, record_emissions=True), Reference(cfg)
    now, added = 0.0, 0
    for op in [*ops, *[("step",)] * 200]:
        if op[0] == "add":
            prompt, max_tokens = op[1], min(op[2], cfg.max_model_len - op[1])
            if max_tokens < 1:
                continue
            rid = f"r{added}"
            added += 1
            engine.add_request(rid, prompt, max_tokens, now, priority=op[3])
            target = engine._seqs[rid].target  # the engine's EOS draw, shared
            ref.add(RefSeq(rid, prompt, target, max_tokens, op[3], now, added))
        elif op[0] == "abort":
            if engine.abort(f"r{op[1]}"):
                ref.abort(f"r{op[1]}")
        else:
            expected = ref.step()
            result = engine.step(now)
            if expected is None:  # idle (the engine may report aborts in a 0-length step)
                assert result is None or (result.duration == 0 and not result.emitted)
                continue
            assert result is not None
            now = result.end
            assert result.duration == expected["duration"]
            assert sorted(result.emitted) == expected["emitted"]
            assert sorted(f.request_id for f in result.finished) == expected["finished"]
            assert result.preempted == expected["preempted"]
            if result.preempted:
                event("a step preempted")
            assert engine.used_blocks == expected["used"]
            assert list(engine._sched.running) == expected["running"]
    assert engine.used_blocks == 0
