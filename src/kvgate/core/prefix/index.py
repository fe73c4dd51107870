"""The prefix index: which blocks each engine has cached, by kvgate's block hashes.

One `PrefixIndex` holds every engine's cache as an LRU of block hashes
(`kvgate.core.prefix.blocks`), sized in blocks, with a reverse map from a block to the
engines that hold it. Two sources fill it:

- **approximate**: what kvgate sent where (`store` on each placement), an LRU model of the
  engine's cache sized from its capacity (`resize`): an engine keeps the blocks of recent
  prompts and evicts the least recently used free ones first;
- **precise**: the engine's own KV events (`kvgate.core.prefix.tracker` maps them to
  kvgate's hashes and calls `store`, `remove` and `clear` here).

A prompt's blocks are touched from its last to its first, so that within one prompt the
leaf is the oldest and goes first, as an engine frees a request's blocks tail first: an
engine that holds block `i` of a sequence almost always holds the blocks before it, and
`matched` finds the cached prefix by bisection (O(log n) lookups per engine).
`deepest` finds the engines holding the longest cached prefix of a prompt anywhere
(O(log n) lookups in all), so routing need not scan every engine to find its cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Sequence

#: Blocks an engine's LRU holds before its capacity is known (a small engine's worth).
DEFAULT_BLOCKS = 4096
#: A node's KV block size until its engine says (vLLM's default).
DEFAULT_BLOCK_SIZE = 16


class PrefixIndex:
    """Each engine's cached blocks (an LRU of block hashes) and who holds each block."""

    __slots__ = ("_caches", "_holders", "_limits")

    def __init__(self) -> None:
        self._caches: dict[str, OrderedDict[int, None]] = {}
        # block -> the engine holding it, or the engines (in the order they took it)
        self._holders: dict[int, str | dict[str, None]] = {}
        self._limits: dict[str, int] = {}

    def resize(self, node_id: str, blocks: int) -> None:
        """Size the node's LRU (its KV capacity in blocks), evicting past it."""
        self._limits[node_id] = max(1, blocks)
        cache = self._caches.get(node_id)
        if cache is not None:
            self._evict(node_id, cache)

    @property
    def empty(self) -> bool:
        """No engine has a block cached."""
        return not self._holders

    def blocks(self, node_id: str) -> int:
        """How many blocks the index holds for the node."""
        cache = self._caches.get(node_id)
        return 0 if cache is None else len(cache)

    def store(self, node_id: str, hashes: Sequence[int]) -> None:
        """The node caches (or used again) these blocks of one sequence, in order."""
        cache = self._caches.get(node_id)
        if cache is None:
            cache = self._caches[node_id] = OrderedDict()
        holders = self._holders
        move = cache.move_to_end
        blocks = reversed(hashes)
        for h in blocks:
            if h in cache:
                move(h)
                # The blocks before a cached one are almost always cached: all moved in C,
                # up to one that is not (it is added, and the loop goes on after it).
                try:
                    deque(map(move, blocks), maxlen=0)
                    break
                except KeyError as missing:
                    h = missing.args[0]
            cache[h] = None
            who = holders.get(h)
            if who is None:
                holders[h] = node_id  # most blocks are on one engine: no dict for them
            elif isinstance(who, str):
                holders[h] = {who: None, node_id: None}
            else:
                who[node_id] = None
        self._evict(node_id, cache)

    def remove(self, node_id: str, hashes: Sequence[int]) -> None:
        """The node evicted these blocks."""
        cache = self._caches.get(node_id)
        if cache is None:
            return
        for h in hashes:
            if cache.pop(h, 0) is None:
                self._drop_holder(h, node_id)

    def clear(self, node_id: str) -> None:
        """The node's cache is empty (reset, restarted, or its events were lost)."""
        cache = self._caches.pop(node_id, None)
        if cache is None:
            return
        for h in cache:
            self._drop_holder(h, node_id)

    def forget(self, node_id: str) -> None:
        """The node left the cluster."""
        self.clear(node_id)
        self._limits.pop(node_id, None)

    def matched(self, node_id: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the node has cached."""
        cache = self._caches.get(node_id)
        if not cache or not hashes:
            return 0
        return leading(cache, hashes)

    def deepest(self, hashes: Sequence[int]) -> tuple[int, tuple[str, ...]]:
        """The longest leading run of `hashes` cached on some engine, and those engines."""
        if not hashes:
            return 0, ()
        n = leading(self._holders, hashes)
        if n == 0:
            return 0, ()
        who = self._holders[hashes[n - 1]]
        return n, (who,) if isinstance(who, str) else tuple(who)

    def _evict(self, node_id: str, cache: OrderedDict[int, None]) -> None:
        limit = self._limits.get(node_id, DEFAULT_BLOCKS)
        while len(cache) > limit:
            h, _ = cache.popitem(last=False)
            self._drop_holder(h, node_id)

    def _drop_holder(self, h: int, node_id: str) -> None:
        holders = self._holders
        who = holders.get(h)
        if who is None:
            return
        if isinstance(who, str):
            if who == node_id:
                del holders[h]
            return
        who.pop(node_id, None)
        if len(who) == 1:
            holders[h] = next(iter(who))
        elif not who:
            del holders[h]


def leading(present: Container[int], hashes: Sequence[int]) -> int:
    """The longest leading run of `hashes` found in `present`, by bisection (a cache holds
    a block's predecessors whenever it holds the block)."""
    if hashes[0] not in present:
        return 0
    lo, hi = 1, len(hashes)  # hashes[:lo] present; hashes[hi:] not known
    if hashes[hi - 1] in present:
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in present:
            lo = mid
        else:
            hi = mid - 1
    return lo
