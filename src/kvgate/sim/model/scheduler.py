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
"""

from __future__ import annotations

from kvgate.sim.model.config import EngineConfig
from kvgate.sim.model.decoding import DecodeBatch
from kvgate.sim.model.sequences import DECODE, DONE, PREFILL, WAITING, Seq, WaitingQueue

#: A step's prefill work: each sequence and the tokens it computes.
Prefills = list[tuple[Seq, int]]


class Scheduler:
    """Which sequences run in a step, and the KV blocks the running ones hold."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._bs = config.block_size
        self.usable = config.usable_blocks
        self.used = 0
        self.running: dict[str, Seq] = {}  # admission order = vLLM's running list
        self.waiting = WaitingQueue(config.scheduling == "priority")
        self.prefilling: dict[str, Seq] = {}  # running, prompt not yet fully computed
        self.decode = DecodeBatch(config.block_size)

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
            self.used += need
        elif self.config.scheduling == "fcfs":
            prefills, budget = self._preempt_from_tail(prefills, budget, preempted)
        else:
            prefills, budget = self._schedule_with_preemption(preempted)
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
        self.used += total
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
            self.used += new_blocks
            if seq.state == PREFILL:
                budget -= chunk
            scheduled[seq.request_id] = (seq, chunk, new_blocks)
        prefills = [(s, c) for s, c, _ in scheduled.values() if s.state == PREFILL]
        left = self.config.max_num_batched_tokens - self.decode.count - sum(c for _, c in prefills)
        return prefills, left

    def _admit_waiting(self, budget: int, prefills: Prefills) -> None:
        cfg = self.config
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            todo = seq.prompt + seq.generated
            if not cfg.enable_chunked_prefill and todo > budget:
                break
            chunk = min(todo, budget)
            blocks = self._ceil(chunk)
            if blocks > self.usable - self.used:
                break
            self.waiting.pop()
            seq.state = PREFILL
            self.running[seq.request_id] = seq
            self.prefilling[seq.request_id] = seq
            self.used += blocks
            budget -= chunk
            prefills.append((seq, chunk))

    def _preempt(self, seq: Seq) -> None:
        """Recompute-mode preemption: free everything, back to the head of the queue."""
        if seq.state == DECODE:
            self.decode.leave(seq)
        else:
            del self.prefilling[seq.request_id]
        self.used -= self._ceil(seq.computed)
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
        self.used -= self._ceil(seq.computed)
        seq.state = DONE
        del self.running[seq.request_id]

    def blocks_of(self, seq: Seq) -> int:
        """Blocks a running sequence holds, recomputed from its counts."""
        if seq.state == DECODE:
            return self._ceil(seq.prompt + seq.gbase + self.decode.g - 1)
        return self._ceil(seq.computed)

    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self._bs)
