"""KV event batches to the replicas: subscribed (at once) or through the owner's view."""

from __future__ import annotations

import pytest

from kvgate.core.prefix.events import KVEventBatch
from kvgate.sim.kv_fanout import KVFanOut, next_sync, view_delivery


def test_next_sync_is_the_first_tick_of_the_replicas_grid_at_or_after_a_time() -> None:
    assert next_sync(0.0, 0.025, 0.05) == 0.025
    assert next_sync(0.025, 0.025, 0.05) == 0.025
    assert next_sync(0.026, 0.025, 0.05) == pytest.approx(0.075)
    assert next_sync(1.0, 0.0, 0.05) == pytest.approx(1.0)


def test_a_view_brings_a_batch_at_the_readers_first_exchange_after_the_owners() -> None:
    # Two replicas, syncs every 50 ms: replica 0 at 0, 50, ... ms, replica 1 at 25, 75, ...
    at = view_delivery(0.010, owner=0, reader=1, gateways=2, interval=0.05, latency=0.001)
    assert at == pytest.approx(0.075 + 0.001)  # owner sends at 50 ms, reader takes at 75
    at = view_delivery(0.030, owner=1, reader=0, gateways=2, interval=0.05, latency=0.001)
    assert at == pytest.approx(0.100 + 0.001)  # owner sends at 75 ms, reader takes at 100
    # However the phases fall: more than the store latency, at most two intervals.
    for t in (0.0, 0.013, 0.049, 0.05, 0.0999):
        for owner, reader in ((0, 1), (1, 0), (0, 2), (2, 1)):
            lag = view_delivery(t, owner, reader, 3, 0.05, 0.001) - t
            assert 0.001 < lag <= 0.1 + 0.001 + 1e-9


def test_subscribed_replicas_get_every_batch_at_once_and_numbered() -> None:
    got: list[tuple[int, str, int]] = []
    later: list[float] = []
    sinks = [lambda n, b, g=g: got.append((g, n, b.seq)) for g in range(2)]
    fan = KVFanOut(2, sinks, None, lambda when, *kv: later.append(when))
    fan.publish(1, "node-1", 0.5, [])
    fan.publish(1, "node-1", 0.6, [])
    assert got == [(0, "node-1", 0), (1, "node-1", 0), (0, "node-1", 1), (1, "node-1", 1)]
    assert later == []


def test_through_views_only_the_owner_gets_a_batch_at_once() -> None:
    got: list[int] = []
    later: list[tuple[float, KVEventBatch]] = []
    seen: list[str] = []
    sinks = [lambda n, b, g=g: got.append(g) for g in range(2)]
    fan = KVFanOut(
        4, [*sinks, None], lambda n, b: seen.append(n),
        lambda when, sink, node_id, batch: later.append((when, batch)),
        via="views", sync=(0.05, 0.001),
    )  # fmt: skip
    fan.publish(3, "node-3", 0.01, [])  # owner: replica 0 (3 % 3); replica 2 takes none
    assert got == [0]
    assert seen == ["node-3"]
    assert [when for when, _ in later] == [pytest.approx(0.05 + 1 / 60 + 0.001)]
    with pytest.raises(ValueError):
        KVFanOut(1, sinks, None, lambda *a: None, via="views")
