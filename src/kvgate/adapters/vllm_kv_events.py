"""vLLM's KV events on the wire: the bytes of one published batch, both ways.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`)
sends each batch as a three-frame ZMQ message on a PUB socket: the topic, the batch's
sequence number (8 bytes, big-endian; consecutive per publisher, so a gap means lost
batches), and the batch in msgpack. A batch is an array `[ts, events, dp_rank]`; each
event a map tagged by `"type"`:

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU",
     "lora_name": nil, "group_idx": 0}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

(vLLM encodes its msgspec structs with `array_like` batches, tagged events and defaults
omitted: `encode_batch` gives the same bytes, checked against vLLM's own encoder in
`tests/adapters/test_vllm_kv_events.py`.) A replay socket (ROUTER) answers a request
holding a start sequence number (8 bytes, big-endian) with every buffered batch from it on
(`[identity, "", topic, seq, payload]` each) and then an end marker whose sequence
number is -1 and payload empty.

Needs `msgspec` (the `kv-events` extra).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvgate.core.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

#: The sequence number of the replay's end marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_encoder = msgspec.msgpack.Encoder()


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM publishes for `batch`."""
    events = [_event(e) for e in batch.events]
    payload: bytes = _encoder.encode([batch.ts, events, batch.data_parallel_rank])
    return payload


def _event(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
            "group_idx": 0,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": 0,
        }
    return {"type": "AllBlocksCleared"}


class WireError(ValueError):
    """A payload that is not a vLLM KV event batch."""


def decode_batch(payload: bytes, seq: int = 0) -> KVEventBatch:
    """The batch in a published payload (`seq`: its sequence frame's number). Events of
    kinds other than the three are skipped; a malformed payload raises `WireError`."""
    try:
        raw = msgspec.msgpack.decode(payload)
        ts, items = float(raw[0]), raw[1]
        rank = raw[2] if len(raw) > 2 else None
        events = tuple(e for e in (_parse(item) for item in items) if e is not None)
    except (msgspec.DecodeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise WireError(f"not a KV event batch: {exc}") from None
    return KVEventBatch(ts, events, seq, rank)


def _parse(item: dict[str, Any]) -> KVEvent | None:
    kind = item["type"]
    if kind == "BlockStored":
        return BlockStored(
            tuple(item["block_hashes"]),
            item["parent_block_hash"],
            tuple(item["token_ids"]),
            int(item["block_size"]),
            item.get("medium"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(item["block_hashes"]), item.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
