"""The fast engine against a naive, per-sequence transcription of vLLM's scheduler.

`kvgate.sim.model.engine` keeps decoding sequences in aggregate form and preempts in O(victims);
this reference walks every sequence every step, exactly in vLLM's order (running list
first, preempting from its tail until the current sequence's new blocks fit, then waiting
requests only if nobody was preempted). Random operation sequences must give identical
steps: durations, tokens, first tokens, finishes, preemptions and block counts.

With prefix caching the reference keeps vLLM's block pool literally: one object per
block, a free queue that hands out its front (never-cached blocks are put back at the
front, cached ones at the back, a request's blocks last first), a hash -> block map, and
a longest-cached-prefix lookup for each request it admits. The engine must agree on the
blocks in use, the cached blocks and their eviction order, the hit counters and the
stored and removed blocks of each step's KV events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvgate.core.prefix.events import BlockRemoved, BlockStored
from kvgate.sim.model.engine import Engine, EngineConfig, StepLatency
from kvgate.sim.model.prefix import engine_hash, output_ids

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
    ids: tuple[int, ...] = ()
    preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    ncached: int = 0  # leading blocks looked at for caching


@dataclass(eq=False)
class Block:
    hash: int | None = None
    ref: int = 0


class Pool:
    """vLLM's block pool, literally (see the module docstring)."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.bs = cfg.block_size
        self.caching = cfg.enable_prefix_caching
        self.queue = [Block() for _ in range(cfg.usable_blocks)]  # the free queue
        self.cached: dict[int, Block] = {}
        self.events: list[tuple[str, int]] = []
        self.queries = self.hits = 0

    @property
    def free(self) -> int:
        return len(self.queue)

    def hashes(self, seq: RefSeq, blocks: int) -> list[int]:
        tokens = seq.ids + output_ids(seq.generated)
        out, parent = [], 0x6B76_6761_7465
        for i in range(blocks):
            parent = hash((parent, tuple(tokens[i * self.bs : (i + 1) * self.bs])))
            out.append(parent)
        return out

    def lookup(self, seq: RefSeq, tokens: int) -> tuple[int, int]:
        if not self.caching:
            return 0, 0
        hit = evictable = 0
        for h in self.hashes(seq, max(0, (tokens - 1) // self.bs)):
            if h not in self.cached:
                break
            hit += 1
            evictable += self.cached[h].ref == 0
        return hit, evictable

    def touch(self, seq: RefSeq, hit: int) -> None:
        for h in self.hashes(seq, hit):
            block = self.cached[h]
            if block.ref == 0:
                self.queue.remove(block)
            block.ref += 1
            seq.blocks.append(block)
        seq.ncached = hit

    def alloc(self, seq: RefSeq, n: int) -> None:
        for _ in range(n):
            block = self.queue.pop(0)
            if block.hash is not None:
                del self.cached[block.hash]
                self.events.append(("removed", block.hash))
                block.hash = None
            block.ref = 1
            seq.blocks.append(block)

    def store(self, seq: RefSeq, tokens: int) -> None:
        full = tokens // self.bs
        if not self.caching or full <= seq.ncached:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.ncached, full):
            if hashes[i] not in self.cached:
                seq.blocks[i].hash = hashes[i]
                self.cached[hashes[i]] = seq.blocks[i]
                self.events.append(("stored", hashes[i]))
        seq.ncached = full

    def free_seq(self, seq: RefSeq) -> None:
        self.store(seq, seq.computed)
        for block in reversed(seq.blocks):
            block.ref -= 1
            if block.ref == 0:
                if block.hash is None:
                    self.queue.insert(0, block)
                else:
                    self.queue.append(block)
        seq.blocks, seq.ncached = [], 0

    def lru(self) -> list[int]:
        return [b.hash for b in self.queue if b.hash is not None]


class Reference:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.pool = Pool(cfg)
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
        pool = self.pool
        for rid in self.pending:
            for seq in self.running:
                if seq.rid == rid:
                    self.running.remove(seq)
                    pool.free_seq(seq)
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
            while need > pool.free:
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
                    taken.pop(victim.rid)
                    if not victim.prefilled:
                        budget += chunks.pop(victim.rid)
                pool.free_seq(victim)  # what it held and what it took this step
                victim.computed, victim.prefilled = 0, False
                victim.preemptions += 1
                self.waiting.appendleft(victim)
                self._sort_waiting()
                preempted.append(victim.rid)
                if victim is seq:
                    break
            if seq not in self.running:
                continue  # preempted itself (the simulator goes on with the rest)
            pool.alloc(seq, need)
            taken[seq.rid] = need
            if not seq.prefilled:
                chunks[seq.rid] = new
                budget -= new
            scheduled.append(seq)
            i += 1
        for seq in scheduled:  # the prefill chunks' full blocks enter the cache
            if not seq.prefilled:
                pool.store(seq, seq.computed + chunks[seq.rid])
        budget = self.cfg.max_num_batched_tokens - sum(
            1 if s.prefilled else chunks[s.rid] for s in scheduled
        )
        if not preempted:
            while budget > 0 and self.waiting and len(self.running) < self.cfg.max_num_seqs:
                seq = self.waiting[0]
                todo = seq.prompt + seq.generated
                hit, evictable = pool.lookup(seq, todo)
                cached = hit * self.bs
                chunk = min(todo - cached, budget)
                if self.ceil(cached + chunk) - hit + evictable > pool.free:
                    break
                self.waiting.popleft()
                self.running.append(seq)
                pool.touch(seq, hit)
                seq.computed = cached
                if seq.preemptions == 0 and pool.caching:
                    pool.queries += seq.prompt
                    pool.hits += cached
                pool.alloc(seq, self.ceil(cached + chunk) - hit)
                pool.store(seq, cached + chunk)
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
                pool.free_seq(seq)
                finished.append(seq.rid)
        events, pool.events = pool.events, []
        return {
            "events": events,
            "duration": duration,
            "emitted": sorted(emitted),
            "finished": sorted(finished),
            "preempted": preempted,
            "used": self.cfg.usable_blocks - pool.free,
            "running": [s.rid for s in self.running],
        }


# Prompts are leading parts of a few token sequences that share their first blocks (and
# a few with one token changed), so that prompts share prefixes of every length.
BASES = (
    tuple(range(100, 120)),
    (*range(100, 108), *range(300, 312)),
    (*range(100, 104), *range(400, 416)),
)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 14),
            st.integers(1, 10),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(-1, 13),
        ),
        st.tuples(
            st.just("add"),
            st.integers(4, 10),
            st.integers(4, 10),
            st.integers(0, 2),
            st.integers(0, 2),
            st.just(-1),
        ),
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
    caching=st.booleans(),
)
def test_fast_engine_matches_the_naive_vllm_walk(
    ops: list[tuple], num_blocks: int, budget: int, scheduling: str, caching: bool
) -> None:
    cfg = EngineConfig(
        num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
        max_model_len=16, latency=LAT, eos_mean_tokens=4.0, scheduling=scheduling,
        enable_prefix_caching=caching,
    )  # type: ignore[arg-type]  # fmt: skip
    engine = Engine(cfg, seed=5, record_emissions=True, record_kv_events=True)
    ref = Reference(cfg)
    now, added = 0.0, 0
    for op in [*ops, *[("step",)] * 200]:
        if op[0] == "add":
            prompt, max_tokens = op[1], min(op[2], cfg.max_model_len - op[1])
            if max_tokens < 1:
                continue
            rid = f"r{added}"
            added += 1
            ids = BASES[op[4]][:prompt]
            if 0 <= op[5] < prompt:
                ids = (*ids[: op[5]], 999, *ids[op[5] + 1 :])
            engine.add_request(rid, prompt, max_tokens, now, priority=op[3], prompt_ids=ids)
            target = engine._seqs[rid].target  # the engine's EOS draw, shared
            ref.add(RefSeq(rid, prompt, target, max_tokens, op[3], now, added, ids=ids))
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
            assert engine.used_blocks == expected["used"] == engine.blocks_in_use()
            assert list(engine._sched.running) == expected["running"]
            assert _flat(result.kv_events) == [
                (kind, engine_hash(h)) for kind, h in expected["events"]
            ]
            if caching:
                cache = engine._sched.cache
                assert cache is not None
                assert list(cache.lru) == ref.pool.lru()
                assert set(cache.refs) == set(ref.pool.cached)
                assert (cache.queries, cache.hits) == (ref.pool.queries, ref.pool.hits)
                if cache.hits:
                    event("a prefix was reused")
                if any(kind == "removed" for kind, _ in expected["events"]):
                    event("a cached block was evicted")
    assert engine.used_blocks == 0


def _flat(events: list) -> list[tuple[str, bytes | int]]:
    out: list[tuple[str, bytes | int]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out += [("stored", h) for h in e.block_hashes]
        elif isinstance(e, BlockRemoved):
            out += [("removed", h) for h in e.block_hashes]
    return out
