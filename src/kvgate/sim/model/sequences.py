"""The simulated engine's requests: one `Seq` per request, and vLLM's waiting queue.

A sequence moves WAITING -> PREFILL -> DECODE -> DONE; preemption sends a running one back
to WAITING (at the head of the queue) and it prefills again. Decoding sequences keep their
token counts relative to the decode batch's step counter (`kvgate.sim.model.decoding`).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class Seq:
    """One request inside the engine. While it decodes, `generated` and `computed` are
    stale: it has generated `gbase + g` tokens (g: the decode batch's step counter)."""

    request_id: str
    prompt: int
    max_tokens: int
    target: int  # output tokens it will produce (max_tokens, or the sampled EOS)
    ignore_eos: bool
    priority: int
    arrival: float
    order: int  # admission order into the engine: the tie-breaker everywhere
    run_order: int = 0  # its place in the running list (set each time it is admitted)
    state: int = WAITING
    generated: int = 0
    computed: int = 0  # tokens whose KV is computed (and held in blocks)
    max_computed: int = 0  # the most it ever had computed (what a re-prefill recomputes)
    gbase: int = 0
    phase: int = 0  # (context tokens - 1) mod block size while it decodes
    first_token_at: float | None = None
    last_token_at: float = 0.0
    gone: bool = False  # its client went away
    gone_at: int = 0  # tokens generated when the client left
    preemptions: int = 0
    uncounted_preemptions: int = 0  # counted when it produces its next token, as vLLM does
    # With prefix caching (`kvgate.sim.model.prefix`): the prompt's token ids (None: it
    # shares nothing), its block hashes known so far, the cached blocks it holds by
    # reference, and how many of its leading blocks were looked at for caching.
    ids: tuple[int, ...] | None = None
    hashes: list[int] | None = None
    refs: list[int] | None = None
    cached_upto: int = 0


def eos_length(rng: random.Random, mean_tokens: float) -> int:
    """Output length when EOS is sampled: geometric with mean `mean_tokens`."""
    p = 1.0 / mean_tokens
    if p >= 1.0:
        return 1
    u = 1.0 - rng.random()  # in (0, 1]
    return 1 + int(math.log(u) / math.log1p(-p))


class WaitingQueue:
    """vLLM's waiting queue: a deque (FCFS) or a heap on (priority, arrival) (priority).

    Removal is lazy: an aborted sequence is marked done and skipped when it reaches the
    front, so `abort` stays O(1).
    """

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._fifo: deque[Seq] = deque()
        self._heap: list[tuple[int, float, int, Seq]] = []
        self.size = 0

    def push_back(self, seq: Seq) -> None:
        self.size += 1
        if self._by_priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.order, seq))
        else:
            self._fifo.append(seq)

    def push_front(self, seq: Seq) -> None:
        self.size += 1
        if self._by_priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.order, seq))
        else:
            self._fifo.appendleft(seq)

    def peek(self) -> Seq | None:
        if self._by_priority:
            while self._heap and self._heap[0][3].state != WAITING:
                heapq.heappop(self._heap)
            return self._heap[0][3] if self._heap else None
        while self._fifo and self._fifo[0].state != WAITING:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> Seq:
        seq = heapq.heappop(self._heap)[3] if self._by_priority else self._fifo.popleft()
        self.size -= 1
        return seq

    def discard(self, seq: Seq) -> None:
        """Called after `seq.state` left WAITING; the entry itself is dropped lazily."""
        self.size -= 1
