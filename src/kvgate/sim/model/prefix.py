"""The simulated engine's prefix cache: vLLM v1's block pool with `enable_prefix_caching`.

A request's tokens are its prompt's ids followed by its output, whose ids are
`output_ids(n)` (the same for every request: a deterministic stand-in for sampling, so a
client that sends the answer back in its next prompt can be modelled exactly). Every full
block is keyed by its chained hash (`kvgate.core.prefix.blocks`).

- A block is *cached* once a request has filled it; requests hold cached blocks by
  reference, so a block held by several is one block of the pool (and of `kv_usage`).
- A cached block whose last holder ended stays cached but free: it counts as free and is
  reused last (`lru`, oldest first); an allocation takes never-cached free blocks first,
  then evicts the least recently freed cached ones (`BlockRemoved`).
- A waiting request reuses the longest run of its leading blocks that is cached, at most
  `tokens - 1` tokens' worth (the last token is always computed): no prefill for them.
  `queries` and `hits` count its prompt tokens and the reused ones when it is first
  admitted (vLLM's `prefix_cache_queries` / `prefix_cache_hits`; a re-admission after a
  preemption is not counted, as vLLM counts it apart).
- A request frees its blocks last to first, so a sequence's tail is evicted before its head.

Simplifications (documented, kept by `tests/sim/test_engine_reference.py`): a prompt block
is cached when its prefill chunk is scheduled (as vLLM does), an output block when its
request leaves the running batch (vLLM caches it when it fills; nobody can reuse a
request's output before the request ends); a block whose hash is already cached when its
request fills it stays private (vLLM caches a second copy under the same hash), so each
cached hash has exactly one block, one `BlockStored` and at most one `BlockRemoved`. A
request sent without token ids shares nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.core.prefix.blocks import ROOT, block_hashes
from kvgate.core.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEvent,
)
from kvgate.sim.model.sequences import Seq

_OUTPUT_PERIOD = 4096
_OUTPUT = tuple(20_000 + (k * 7919) % 9973 for k in range(_OUTPUT_PERIOD))


def output_ids(count: int) -> tuple[int, ...]:
    """The ids of a request's first `count` output tokens."""
    if count <= _OUTPUT_PERIOD:
        return _OUTPUT[:count]
    return (_OUTPUT * (count // _OUTPUT_PERIOD + 1))[:count]


def engine_hash(block_hash: int) -> EngineBlockHash:
    """The key the simulated engine publishes for a block: opaque bytes, as vLLM's are."""
    return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")


class PrefixCache:
    """The cached blocks of one engine (see the module docstring)."""

    __slots__ = ("block_size", "events", "hits", "lru", "queries", "refs")

    def __init__(self, block_size: int, record_events: bool = False) -> None:
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # cached hash -> requests holding it (0: free)
        self.lru: OrderedDict[int, None] = OrderedDict()  # free cached, least recent first
        self.events: list[KVEvent] | None = [] if record_events else None
        self.queries = 0
        self.hits = 0

    # --- hashes of a request's blocks -----------------------------------------------------

    def hashes(self, seq: Seq, blocks: int) -> list[int]:
        """`seq`'s first `blocks` block hashes (fewer without ids), computed once."""
        known = seq.hashes
        if known is None:
            known = seq.hashes = []
        if seq.ids is None or len(known) >= blocks:
            return known
        bs = self.block_size
        start = len(known) * bs
        tokens = self.token_ids(seq, blocks * bs)
        known += block_hashes(tokens, bs, parent=known[-1] if known else ROOT, start=start)
        return known

    @staticmethod
    def token_ids(seq: Seq, count: int) -> tuple[int, ...]:
        """The ids of `seq`'s first `count` tokens: its prompt, then its output."""
        ids = seq.ids
        assert ids is not None
        if count <= len(ids):
            return ids[:count]
        return ids + output_ids(count - len(ids))

    # --- admission ------------------------------------------------------------------------

    def lookup(self, seq: Seq, tokens: int) -> tuple[int, int]:
        """(leading blocks of `seq`'s `tokens` cached, how many of those are free): at most
        `tokens - 1` tokens' worth, the last token being always computed."""
        limit = (tokens - 1) // self.block_size
        if seq.ids is None or limit <= 0:
            return 0, 0
        refs = self.refs
        hit = free = 0
        for h in self.hashes(seq, limit)[:limit]:
            held = refs.get(h)
            if held is None:
                break
            hit += 1
            if held == 0:
                free += 1
        return hit, free

    def touch(self, seq: Seq, blocks: int) -> None:
        """`seq` takes its first `blocks` blocks from the cache (found by `lookup`)."""
        refs, lru = self.refs, self.lru
        taken = self.hashes(seq, blocks)[:blocks]
        for h in taken:
            held = refs[h]
            if held == 0:
                del lru[h]
            refs[h] = held + 1
        seq.refs = taken
        seq.cached_upto = blocks

    def evict(self, count: int) -> None:
        """Reuse the `count` least recently freed cached blocks for new tokens."""
        refs, popitem = self.refs, self.lru.popitem
        removed = []
        for _ in range(count):
            h, _ = popitem(last=False)
            del refs[h]
            removed.append(h)
        if self.events is not None and removed:
            self.events.extend(BlockRemoved((engine_hash(h),)) for h in removed)

    # --- filling and freeing ----------------------------------------------------------------

    def store(self, seq: Seq, tokens: int) -> None:
        """`seq` has filled its first `tokens` tokens: cache its new full blocks."""
        bs = self.block_size
        full = tokens // bs
        start = seq.cached_upto
        if seq.ids is None or full <= start:
            return
        hashes = self.hashes(seq, full)
        refs = self.refs
        mine = seq.refs
        if mine is None:
            mine = seq.refs = []
        runs: list[tuple[int, int]] = []
        run = -1
        for i in range(start, full):
            h = hashes[i]
            if h in refs:  # another request filled the same block first: ours stays private
                if run >= 0:
                    runs.append((run, i))
                    run = -1
                continue
            refs[h] = 1
            mine.append(h)
            if run < 0:
                run = i
        if run >= 0:
            runs.append((run, full))
        seq.cached_upto = full
        if self.events is not None and runs:
            ids = self.token_ids(seq, full * bs)
            for a, b in runs:
                self.events.append(
                    BlockStored(
                        tuple(engine_hash(h) for h in hashes[a:b]),
                        engine_hash(hashes[a - 1]) if a else None,
                        ids[a * bs : b * bs],
                        bs,
                    )
                )

    def release(self, seq: Seq) -> int:
        """`seq` frees its cached blocks, last first; returns how many became free."""
        refs, lru = self.refs, self.lru
        freed = 0
        for h in reversed(seq.refs or ()):
            held = refs[h] - 1
            refs[h] = held
            if held == 0:
                lru[h] = None
                freed += 1
        seq.refs = None
        seq.cached_upto = 0
        return freed

    def reset(self) -> None:
        """Forget every free cached block (vLLM's `reset_prefix_cache`, when none is held)."""
        self.refs.clear()
        self.lru.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        events = self.events
        if not events:
            return []
        self.events = []
        return events
