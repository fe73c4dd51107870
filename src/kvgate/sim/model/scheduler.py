"""The simulated engine's scheduler and KV block pool, following vLLM v1's `schedule()`.

A sequence that has computed `c` tokens holds `ceil(c / block_size)` blocks; a step that
computes `k` more first allocates `ceil((c + k) / block_size)`. Each step schedules the
running sequences first (a decoding one takes one token of the `max_num_batched_tokens`
budget, a prefilling one a chunk of what is left), then, only if nobody was preempted this
step, admits waiting requests in FCFS order (or by priority) while `max_num_seqs`, the
token budget and the free blocks allow; the head of the queue blocks the queue. When a
running sequence needs a block and none is free, the newest running sequence (or the
lowest-priority one) is preempted in recompute mode: its blocks are freed and it goes back
to the head of the waiting queue.

With `enable_prefix_caching` the pool caches full blocks (`kvgate.sim.model.prefix`):
`used` counts the blocks some request holds, a block shared by several once; a waiting
request starts with its cached leading blocks already computed, and new blocks come from
the never-cached free ones first, then from the least recently freed cached ones.
"""

from __future__ import annotations

from kvgate.sim.model.config import EngineConfig
from kvgate.sim.model.decoding import DecodeBatch
from kvgate.sim.model.prefix import PrefixCache
from kvgate.sim.model.sequences import DECODE, DONE, PREFILL, WAITING, Seq, WaitingQueue

#: A step's prefill work: each sequence and the tokens it computes.
Prefills = list[tuple[Seq, int]]


class Scheduler:
    """Which sequences run in a step, and the KV blocks the running ones hold."""

    def __init__(self, config: EngineConfig, record_kv_events: bool = False) -> None:
        self.config = config
        self._bs = config.block_size
        self.usable = config.usable_blocks
        self.used = 0  # blocks held by a running sequence (a shared one counted once)
        self.cache = (
            PrefixCache(config.block_size, record_kv_events)
            if config.enable_prefix_caching
            else None
        )
        self.running: dict[str, Seq] = {}  # admission order = vLLM's running list
        self.waiting = WaitingQueue(config.scheduling == "priority")
        self.prefilling: dict[str, Seq] = {}  # running, prompt not yet fully computed
        self.decode = DecodeBatch(config.block_size)
        self._admitted = 0  # admissions into the running list, for `Seq.run_order`

    def schedule(self) -> tuple[Prefills, list[str]]:
        """Allocate the blocks of one step: its prefill chunks, and the ids preempted to
        make room (the decoding sequences that remain each compute one token)."""
        decode = self.decode
        budget = self.config.max_num_batched_tokens - decode.count
        prefills: Prefills = []
        preempted: list[str] = []
        need = decode.new_blocks()
        for seq in self.prefilling.values():
            chunk = min(seq.prompt + seq.generated - seq.computed, budget)
            if chunk <= 0:
                continue
            budget -= chunk
            prefills.append((seq, chunk))
            need += self._ceil(seq.computed + chunk) - self._ceil(seq.computed)
        if need <= self.usable - self.used:
            if self.cache is None:
                self.used += need
            else:
                self._take(need)
        elif self.config.scheduling == "fcfs" and self.cache is None:
            prefills, budget = self._preempt_from_tail(prefills, budget, preempted)
        else:  # which cached blocks are evicted depends on the walk's order: walk it
            prefills, budget = self._schedule_with_preemption(preempted)
        if self.cache is not None:
            for seq, chunk in prefills:
                self.cache.store(seq, seq.computed + chunk)
        if not preempted:
            self._admit_waiting(budget, prefills)
        return prefills, preempted

    def _preempt_from_tail(
        self, prefills: Prefills, budget: int, preempted: list[str]
    ) -> tuple[Prefills, int]:
        """FCFS preemption in O(victims): vLLM walks the running list in order and, when a
        sequence's new blocks do not fit, preempts the *last* running sequence until they
        do (or until it is the one preempted). The survivors are therefore the longest
        prefix of the running list whose new blocks fit in what is free plus what the
        preempted tail held, which is what popping the tail until the total fits gives."""
        chunks = {seq.request_id: chunk for seq, chunk in prefills}
        need_p = {
            rid: self._ceil(self.running[rid].computed + c) - self._ceil(self.running[rid].computed)
            for rid, c in chunks.items()
        }
        need = sum(need_p.values())
        while True:
            total = need + self.decode.new_blocks()
            if total <= self.usable - self.used or not self.running:
                break
            victim = next(reversed(self.running.values()))
            if victim.request_id in chunks:
                need -= need_p.pop(victim.request_id)
                budget += chunks.pop(victim.request_id)
            self._preempt(victim)
            preempted.append(victim.request_id)
        self._take(total)
        kept = [(seq, c) for seq, c in prefills if seq.request_id in chunks]
        return kept, budget

    def _schedule_with_preemption(self, preempted: list[str]) -> tuple[Prefills, int]:
        """Slow path: walk the running list in order, preempting from its tail (or the
        lowest priority) until each sequence's new blocks fit, as vLLM does."""
        by_priority = self.config.scheduling == "priority"
        budget = self.config.max_num_batched_tokens - self.decode.count
        scheduled: dict[str, tuple[Seq, int, int]] = {}  # id -> (seq, chunk, blocks)
        order = list(self.running.values())
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            if seq.request_id not in self.running:
                continue  # preempted earlier in this walk
            if seq.state == DECODE:
                computed, chunk = seq.prompt + seq.gbase + self.decode.g - 1, 1
            else:
                computed = seq.computed
                chunk = min(seq.prompt + seq.generated - computed, budget)
                if chunk <= 0:
                    continue
            new_blocks = self._ceil(computed + chunk) - self._ceil(computed)
            while new_blocks > self.usable - self.used:
                victim = (
                    max(self.running.values(), key=lambda s: (s.priority, s.arrival))
                    if by_priority
                    else next(reversed(self.running.values()))
                )
                taken = scheduled.pop(victim.request_id, None)
                if taken is not None:  # priority mode may evict an already-scheduled seq
                    self.used -= taken[2]
                    if victim.state == PREFILL:
                        budget += taken[1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if seq.state == WAITING:  # it was preempted itself
                continue
            self._take(new_blocks)
            if seq.state == PREFILL:
                budget -= chunk
            scheduled[seq.request_id] = (seq, chunk, new_blocks)
        prefills = [(s, c) for s, c, _ in scheduled.values() if s.state == PREFILL]
        left = self.config.max_num_batched_tokens - self.decode.count - sum(c for _, c in prefills)
        return prefills, left

    def _admit_waiting(self, budget: int, prefills: Prefills) -> None:
        cfg = self.config
        cache = self.cache
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            todo = seq.prompt + seq.generated
            hit = free_hit = 0
            if cache is not None:
                hit, free_hit = cache.lookup(seq, todo)
            cached = hit * self._bs
            if not cfg.enable_chunked_prefill and todo - cached > budget:
                break
            chunk = min(todo - cached, budget)
            blocks = self._ceil(cached + chunk) - hit
            if blocks + free_hit > self.usable - self.used:
                break
            self.waiting.pop()
            seq.state = PREFILL
            self._admitted += 1
            seq.run_order = self._admitted
            self.running[seq.request_id] = seq
            self.prefilling[seq.request_id] = seq
            if cache is not None:
                if hit:
                    cache.touch(seq, hit)
                    self.used += free_hit
                    seq.computed = cached
                if seq.preemptions == 0:
                    cache.queries += seq.prompt
                    cache.hits += cached
            self._take(blocks)
            if cache is not None:
                cache.store(seq, cached + chunk)
            budget -= chunk
            prefills.append((seq, chunk))

    def _preempt(self, seq: Seq) -> None:
        """Recompute-mode preemption: free everything, back to the head of the queue."""
        if seq.state == DECODE:
            self.decode.leave(seq)
        else:
            del self.prefilling[seq.request_id]
        self._free(seq)
        seq.max_computed = max(seq.max_computed, seq.computed)
        seq.computed = 0
        seq.state = WAITING
        seq.preemptions += 1
        seq.uncounted_preemptions += 1
        del self.running[seq.request_id]
        self.waiting.push_front(seq)

    def start_decoding(self, seq: Seq) -> None:
        """`seq` computed its whole context and sampled a token: it decodes from now on."""
        del self.prefilling[seq.request_id]
        self.decode.enter(seq)

    def remove(self, seq: Seq) -> None:
        """Take out a sequence that is aborted, wherever it is."""
        if seq.state == WAITING:
            seq.state = DONE
            self.waiting.discard(seq)
            return
        if seq.state == DECODE:
            self.decode.leave(seq)
        else:
            del self.prefilling[seq.request_id]
        self.release(seq)

    def release(self, seq: Seq) -> None:
        """Free a running sequence's blocks and forget it (it left the decode batch)."""
        self._free(seq)
        seq.state = DONE
        del self.running[seq.request_id]

    def _take(self, blocks: int) -> None:
        """Allocate `blocks` free blocks: never-cached ones first, then cached ones."""
        cache = self.cache
        if cache is not None:
            short = blocks - (self.usable - self.used - len(cache.lru))
            if short > 0:
                cache.evict(short)
        self.used += blocks

    def _free(self, seq: Seq) -> None:
        """Free a sequence's blocks (its full blocks stay cached, free, with caching on)."""
        held = -(-seq.computed // self._bs)
        cache = self.cache
        if cache is None:
            self.used -= held
            return
        cache.store(seq, seq.computed)
        private = held - len(seq.refs or ())
        self.used -= private + cache.release(seq)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        if self.cache is None or self.used:
            return False
        self.cache.reset()
        return True

    def blocks_in_use(self) -> int:
        """Blocks some running sequence holds, recounted from scratch (for audits)."""
        shared: set[int] = set()
        private = 0
        for seq in self.running.values():
            refs = seq.refs or ()
            shared.update(refs)
            private += self.blocks_of(seq) - len(refs)
        return private + len(shared)

    def blocks_of(self, seq: Seq) -> int:
        """Blocks a running sequence holds, recomputed from its counts."""
        if seq.state == DECODE:
            return self._ceil(seq.prompt + seq.gbase + self.decode.g - 1)
        return self._ceil(seq.computed)

    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self._bs)
