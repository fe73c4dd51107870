"""The simulated engine's decoding sequences, kept in aggregate so a step costs O(events).

Every decoding sequence produces one token per step, so its own counts need not move: the
batch keeps a step counter `g`, and a sequence that entered with `generated` tokens keeps
`gbase = generated - g` (it has generated `gbase + g` since). What a step needs of all of
them is kept as totals updated when a sequence enters or leaves: how many decode, how many
of those belong to clients that left (zombies), how many sit at each position within their
last KV block (the ones at its end take a new block next step), the sum of their context
lengths, and a heap of the step at which each one finishes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvgate.sim.model.sequences import DECODE, Seq


class DecodeBatch:
    """The decoding sequences of one engine, in aggregate (see the module docstring)."""

    __slots__ = (
        "_finish_heap",
        "_phase_count",
        "block_size",
        "context_base",
        "count",
        "g",
        "zombies",
    )

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.g = 0  # decode steps taken so far; a decoding seq has generated gbase + g
        self.count = 0
        self.zombies = 0  # decoding sequences whose client went away
        self.context_base = 0  # sum over decoding seqs of (prompt + gbase - 1)
        self._phase_count = [0] * block_size
        self._finish_heap: list[tuple[int, int, Seq]] = []

    def new_blocks(self) -> int:
        """KV blocks the next decode step allocates: one per sequence whose last block is
        full."""
        return self._phase_count[-self.g % self.block_size] if self.count else 0

    def context_tokens(self) -> int:
        """Tokens the decoding sequences attend to in the next step."""
        return self.context_base + self.count * self.g

    def enter(self, seq: Seq) -> None:
        """`seq` (its `generated` up to date) starts decoding."""
        seq.state = DECODE
        seq.gbase = seq.generated - self.g
        seq.phase = (seq.prompt + seq.gbase - 1) % self.block_size
        self._phase_count[seq.phase] += 1
        self.context_base += seq.prompt + seq.gbase - 1
        self.count += 1
        if seq.gone:
            self.zombies += 1
        heapq.heappush(self._finish_heap, (seq.target - seq.gbase, seq.run_order, seq))

    def leave(self, seq: Seq) -> None:
        """Materialise a decoding sequence's counts and take it out of the aggregates."""
        seq.generated = seq.gbase + self.g
        seq.computed = seq.prompt + seq.generated - 1
        self._phase_count[seq.phase] -= 1
        self.context_base -= seq.prompt + seq.gbase - 1
        self.count -= 1
        if seq.gone:
            self.zombies -= 1

    def client_gone(self, seq: Seq) -> None:
        """The client of decoding `seq` went away: its tokens from now on are zombies."""
        seq.gone_at = seq.gbase + self.g
        self.zombies += 1

    def finished(self) -> Iterator[Seq]:
        """Take out (`leave`) and yield each sequence that produced its last token by now,
        in running-list order (the order vLLM frees them in)."""
        heap = self._finish_heap
        while heap and heap[0][0] <= self.g:
            _, _, seq = heapq.heappop(heap)
            if seq.state != DECODE or seq.target - seq.gbase != self.g:
                continue  # stale entry: the sequence was preempted or aborted since
            self.leave(seq)
            yield seq
