"""Held blocks: the KV blocks the running requests on each node hold, each counted once.

An engine with prefix caching stores a block once however many running requests use it
(vLLM counts references; `kv_cache_usage_perc` counts the block once). So a request costs a
node only the blocks of its prompt that no request running there holds already, plus its
output. `HeldBlocks` keeps, per node, each held block's holders (ticket keys) and its
*owner*: the one hold whose prompt counts the block (`kvgate.core.plan.holds`). A newcomer
owns only the blocks it adds (`take` returns how many of its leading blocks were held).

A shared block frees when its last holder ends. When its owner ends first, the block
passes to the holder expected to end last (`drop` returns, per heir, how many blocks it
inherits, and the holds move those tokens from the owner's prompt to the heir's), so the
envelope (`kvgate.core.plan.forecast`) frees it at the right end. Blocks are named by their
chained hashes (`kvgate.core.prefix.blocks`): a request's held blocks are a leading run of
its prompt's, so a node's held prefix of a prompt is found by bisection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.index import leading


class HeldBlocks:
    """Per node: each held block's holders and owner; per hold: its blocks."""

    __slots__ = ("_blocks", "_holders", "_owner")

    def __init__(self) -> None:
        self._holders: dict[str, dict[int, dict[str, None]]] = {}  # node -> block -> keys
        self._owner: dict[str, dict[int, str]] = {}  # node -> block -> owning key
        self._blocks: dict[str, tuple[str, Sequence[int]]] = {}  # key -> (node, blocks)

    def held(self, node_id: str, hashes: Sequence[int], most: int) -> int:
        """How many leading blocks of `hashes` (at most `most`) running requests on the
        node hold."""
        holders = self._holders.get(node_id)
        if not holders or not hashes or most <= 0:
            return 0
        return min(most, leading(holders, hashes))

    def take(self, key: str, node_id: str, hashes: Sequence[int], most: int) -> int:
        """The hold `key` on the node holds these blocks; returns how many it shares (held
        already, at most `most`: owned by others), the rest it owns."""
        holders = self._holders.get(node_id)
        if holders is None:
            holders = self._holders[node_id] = {}
            self._owner[node_id] = {}
        owner = self._owner[node_id]
        shared = min(most, leading(holders, hashes)) if holders and hashes and most > 0 else 0
        for i, h in enumerate(hashes):
            who = holders.get(h)
            if who is None:
                holders[h] = {key: None}
            else:
                who[key] = None
            if i >= shared and h not in owner:
                owner[h] = key
        self._blocks[key] = (node_id, hashes)
        return shared

    def drop(self, key: str, last_end: Callable[[str], float]) -> dict[str, int]:
        """The hold `key` ended: its blocks lose a holder. Returns, per heir key, how many
        of the blocks it owned pass to that heir (the remaining holder whose `last_end`,
        the expected end, is latest)."""
        entry = self._blocks.pop(key, None)
        if entry is None:
            return {}
        node_id, hashes = entry
        holders = self._holders[node_id]
        owner = self._owner[node_id]
        heirs: dict[str, int] = {}
        for h in hashes:
            who = holders.get(h)
            if who is None:
                continue
            who.pop(key, None)
            if not who:
                del holders[h]
                owner.pop(h, None)
            elif owner.get(h) == key:
                heir = max(who, key=last_end)
                owner[h] = heir
                heirs[heir] = heirs.get(heir, 0) + 1
        if not holders:
            del self._holders[node_id]
            del self._owner[node_id]
        return heirs

    def blocks_on(self, node_id: str) -> int:
        """Distinct blocks held on the node."""
        holders = self._holders.get(node_id)
        return 0 if holders is None else len(holders)


def reusable(tokens: int, block_size: int) -> int:
    """The most blocks of a `tokens`-token prompt an engine reuses: never the block of its
    last token, which it computes again to produce the first output."""
    return (tokens - 1) // block_size if tokens > 0 else 0


class PromptBlocks:
    """The block hashes of the prompt being decided, computed once per block size: a
    decision asks for them on every candidate and again when it opens the hold."""

    __slots__ = ("_hashes", "_ids")

    def __init__(self) -> None:
        self._ids: tuple[int, ...] | None = None
        self._hashes: dict[int, list[int]] = {}

    def of(self, ids: tuple[int, ...], block_size: int) -> list[int]:
        """The hashes of the full blocks of `ids` (`block_hashes`)."""
        if ids is not self._ids:
            self._ids = ids
            self._hashes = {}
        out = self._hashes.get(block_size)
        if out is None:
            out = self._hashes[block_size] = block_hashes(ids, block_size)
        return out
