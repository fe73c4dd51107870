"""vLLM's KV event wire format: the bytes vLLM's own encoder gives for a batch, both ways."""

from __future__ import annotations

import pytest

pytest.importorskip("msgspec")

from kvgate.adapters.vllm_kv_events import WireError, decode_batch, encode_batch
from kvgate.core.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

ONE, TWO = b"\x01" * 8, b"\x02" * 8
BATCH = KVEventBatch(
    1.5,
    (
        BlockStored((ONE, 7), None, (1, 2, 3, 4, 5, 6, 7, 8), 4),
        BlockStored((TWO,), ONE, (9, 10, 11, 12), 4),
        BlockRemoved((ONE,)),
        AllBlocksCleared(),
    ),
)
# `msgspec.msgpack.Encoder().encode(KVEventBatch(...))` with vLLM 0.32's own classes
# (vllm/distributed/kv_events.py) for the same events, group_idx 0 as its block pool sets.
VLLM_BYTES = bytes.fromhex(
    "93cb3ff80000000000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865"
    "7392c408010101010101010107b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964"
    "73980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da34750"
    "55a96c6f72615f6e616d65c0a967726f75705f6964780089a474797065ab426c6f636b53746f726564"
    "ac626c6f636b5f68617368657391c4080202020202020202b1706172656e745f626c6f636b5f686173"
    "68c4080101010101010101a9746f6b656e5f69647394090a0b0caa626c6f636b5f73697a6504a76c6f"
    "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f696478008"
    "4a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c408010101010101"
    "0101a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b7343"
    "6c656172656400"
)


def test_the_payload_is_byte_for_byte_vllms() -> None:
    assert encode_batch(BATCH) == VLLM_BYTES


def test_a_payload_decodes_to_the_batch() -> None:
    assert decode_batch(VLLM_BYTES, seq=9) == KVEventBatch(BATCH.ts, BATCH.events, 9, 0)


def test_garbage_is_a_wire_error() -> None:
    for payload in (b"", b"\x93\x01", encode_batch(BATCH)[:-3]):
        with pytest.raises(WireError):
            decode_batch(payload)
