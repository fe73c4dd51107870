"""The KV events an engine publishes about its prefix cache, as plain records.

vLLM (`--kv-events-config`) publishes, once per engine step that changed its cache, a
batch (`KVEventBatch`: a timestamp, the events in order, the data-parallel rank) of:

- `BlockStored`: full blocks entered the cache, in order. `block_hashes` are the engine's
  own keys (bytes or ints, opaque: vLLM's are seeded per deployment), `parent_block_hash`
  the key of the block before the first one (None: the first one starts the sequence),
  `token_ids` the tokens of all of them (`len(block_hashes) * block_size`);
- `BlockRemoved`: blocks evicted (a free cached block reused for new tokens);
- `AllBlocksCleared`: the whole cache was reset.

A consumer names blocks by kvgate's own hashes (`kvgate.core.prefix.blocks`): the parent's
kvgate hash (kept per engine key) chained over `token_ids` gives each stored block's.
The simulated engines produce these records; in virtual time they reach a `KVEventSink`
in-process, and the live simulator sends them in vLLM's wire format
(`kvgate.sim.kv_publisher`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

#: An engine's key for a block (vLLM's `ExternalBlockHash`).
EngineBlockHash = bytes | int


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's events; `seq` is the publisher's sequence number (gaps: events lost)."""

    ts: float
    events: tuple[KVEvent, ...]
    seq: int = 0
    data_parallel_rank: int | None = 0


@runtime_checkable
class KVEventSink(Protocol):
    """What takes an engine's KV events: the virtual runner hands each engine's batches
    to every policy that implements it, as they are published."""

    def kv_events(self, node_id: str, batch: KVEventBatch) -> None: ...
