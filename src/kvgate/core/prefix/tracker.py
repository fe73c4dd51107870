"""Following an engine's KV events into the prefix index (the precise source).

An engine names its blocks by its own hashes (vLLM seeds them per deployment), so the
tracker keeps, per engine, the map from the engine's key of each cached block to kvgate's
(`kvgate.core.prefix.blocks`): a `BlockStored` carries the parent's engine key and the
blocks' token ids, so kvgate's hashes are the parent's kvgate hash chained over those ids.
`BlockRemoved` drops blocks, `AllBlocksCleared` empties the engine's entry.

Lost events make the index wrong in ways no later event repairs, so a batch whose sequence
number does not follow the last one (`KVEventBatch.seq`), or a stored block whose parent is
unknown, clears the engine's entry and reports it (`apply` returns False): the shell then
replays what it can from the engine (vLLM's replay socket) or lets the index rebuild from
the events that follow. An engine that restarted says so with `AllBlocksCleared` or with a
sequence that starts again; both clear it, and so does the policy when the engine's prefix
cache counters start again (`AdaptivePolicy`, from its samples: an engine without events).
Meanwhile the engine has no cached prefix in the index, and routing ranks it by headroom
alone.
"""

from __future__ import annotations

from kvgate.core.prefix.blocks import ROOT, block_hashes
from kvgate.core.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEventBatch,
)
from kvgate.core.prefix.index import PrefixIndex


class EventTracker:
    """Applies each engine's KV event batches to a `PrefixIndex`."""

    __slots__ = ("_keys", "_seq", "index", "resyncs")

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._keys: dict[str, dict[EngineBlockHash, int]] = {}
        self._seq: dict[str, int] = {}
        self.resyncs: dict[str, int] = {}  # per engine: how often its entry was cleared

    def apply(self, node_id: str, batch: KVEventBatch) -> bool:
        """Apply one batch; False when events were lost before it (the entry was cleared)."""
        ok = True
        last = self._seq.get(node_id)
        if last is not None and batch.seq != last + 1:
            self.reset(node_id)
            ok = False
        self._seq[node_id] = batch.seq
        keys = self._keys.get(node_id)
        if keys is None:
            keys = self._keys[node_id] = {}
        index = self.index
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                root = ROOT if parent is None else keys.get(parent)
                if root is None:
                    self.reset(node_id)
                    keys = self._keys[node_id] = {}
                    ok = False
                    continue
                ours = block_hashes(event.token_ids, event.block_size, parent=root)
                for theirs, mine in zip(event.block_hashes, ours, strict=False):
                    keys[theirs] = mine
                index.store(node_id, ours)
            elif isinstance(event, BlockRemoved):
                gone = [k for h in event.block_hashes if (k := keys.pop(h, None)) is not None]
                index.remove(node_id, gone)
            elif isinstance(event, AllBlocksCleared):
                keys.clear()
                index.clear(node_id)
        return ok

    def reset(self, node_id: str) -> None:
        """Forget what the engine cached (events lost, engine restarted)."""
        self._keys.pop(node_id, None)
        self._seq.pop(node_id, None)
        self.index.clear(node_id)
        self.resyncs[node_id] = self.resyncs.get(node_id, 0) + 1

    def forget(self, node_id: str) -> None:
        self._keys.pop(node_id, None)
        self._seq.pop(node_id, None)
        self.resyncs.pop(node_id, None)
