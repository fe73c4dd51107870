"""The KV event stream measured: its rates and bytes, a view's net delta per sync, the CPU
of both ways to the replicas."""

from __future__ import annotations

import pytest

from kvgate.adapters.vllm_kv_events import encode_batch
from kvgate.bench.kv_stream import FRAME_BYTES, StreamMeter, decode_cost
from kvgate.core.prefix.events import BlockRemoved, BlockStored, KVEventBatch
from kvgate.sim.model.prefix import engine_hash


def _stored(*hashes: int, parent: int | None = None) -> BlockStored:
    ids = tuple(range(16 * len(hashes)))
    keys = tuple(engine_hash(h) for h in hashes)
    return BlockStored(keys, None if parent is None else engine_hash(parent), ids, 16)


def test_a_views_delta_is_the_net_change_of_a_sync_interval() -> None:
    meter = StreamMeter(0.05)
    first = KVEventBatch(0.01, (_stored(1, 2, 3),), 0)
    meter("node-0", first)
    # Within the same interval: 3 removed again (no change), 4 stored.
    meter("node-0", KVEventBatch(0.02, (BlockRemoved((engine_hash(3),)), _stored(4)), 1))
    # The next interval: 1 removed.
    meter("node-0", KVEventBatch(0.07, (BlockRemoved((engine_hash(1),)),), 2))
    meter.finish()
    engine = meter.engines["node-0"]
    assert [n for n, _ in engine.deltas] == [3, 1]  # +1 +2 +4, then -1
    assert engine.stored == 4 and engine.removed == 2 and engine.batches == 3
    assert engine.bytes >= len(encode_batch(first)) + FRAME_BYTES
    assert meter.busiest() == "node-0"
    summary = meter.summary()
    assert summary["delta_hashes_max"] == 3
    assert summary["stored_hashes_per_s"] == pytest.approx(4 / 0.06)


def test_decode_cost_times_both_ways_on_a_recorded_stream() -> None:
    meter = StreamMeter(0.05)
    for seq in range(20):
        parent = seq * 10 if seq else None
        meter("node-0", KVEventBatch(seq * 0.03, (_stored(seq * 10 + 10, parent=parent),), seq))
    meter.finish()
    cost = decode_cost(meter.payloads["node-0"], meter.delta_texts["node-0"], 1000, repeat=1)
    assert cost["batches"] == 20 and cost["stored_blocks"] == 20
    assert cost["subscribe_us_per_batch"] > 0 and cost["view_us_per_delta"] > 0
    assert cost["deltas"] == len(meter.delta_texts["node-0"]) > 0
