"""The gateway's KV event subscriber: an engine's events into the prefix index, with the
replay socket after lost batches and a clean slate after an engine restart."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvgate.adapters.vllm_kv_events import encode_batch
from kvgate.core.clock import ManualClock
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.routing import PrefixRouting
from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.events import BlockStored, KVEventBatch
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway.engines.kv_events import KVEventSubscriber, split_endpoint
from kvgate.sim.kv_publisher import KVEventsConfig, KVPublisher

pytestmark = pytest.mark.timeout(60)
BS = 16
LIMIT_S = 2.0  # issue 24: a loss or a restart is resynced within 2 s
IDS = tuple(range(5000, 5000 + 8 * BS))  # 8 blocks
HASHES = block_hashes(IDS, BS)


def _stored(lo: int, hi: int) -> BlockStored:
    """Blocks lo..hi-1 of IDS, with the engine's keys 100 + i."""
    parent = None if lo == 0 else 100 + lo - 1
    keys = tuple(100 + i for i in range(lo, hi))
    return BlockStored(keys, parent, IDS[lo * BS : hi * BS], BS)


def _policy() -> tuple[AdaptivePolicy, PrefixRouting]:
    policy = AdaptivePolicy(AdmissionSettings(), ManualClock(0.0), routing="prefix")
    assert isinstance(policy.routing, PrefixRouting)
    return policy, policy.routing


async def _until(condition: Callable[[], bool]) -> float:
    """Seconds until `condition()` held (polled); fails after `LIMIT_S`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < LIMIT_S, "not within the time allowed"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_the_endpoint_names_its_replay_socket() -> None:
    assert split_endpoint("tcp://h:5557?replay=tcp://h:5558") == ("tcp://h:5557", "tcp://h:5558")
    assert split_endpoint("tcp://h:5557") == ("tcp://h:5557", None)
    with pytest.raises(ValueError, match="ZMQ endpoint"):
        split_endpoint("http://h:5557")


async def test_lost_batches_are_replayed_and_a_restart_clears() -> None:
    publisher = KVPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    )
    publisher.start()
    policy, routing = _policy()
    # Published before anyone listened: the subscriber replays it at its start.
    publisher.publish(0.0, [_stored(0, 2)])
    url = f"{publisher.endpoint}?replay={publisher.replay_endpoint}"
    subscriber = KVEventSubscriber("e", url, policy.kv_events)
    task = asyncio.create_task(subscriber.run())
    try:
        await _until(lambda: routing.index.matched("e", HASHES) == 2)
        await asyncio.sleep(0.3)  # a SUB socket misses what is sent before it joins
        # Batch 1 is lost on the wire (kept only in the replay buffer); batch 2 reveals it.
        publisher._buffer.append((1, encode_batch(KVEventBatch(0.1, (_stored(2, 4),), 1))))
        publisher._next_seq = 2
        publisher.publish(0.2, [_stored(4, 6)])
        took = await _until(lambda: routing.index.matched("e", HASHES) == 6)
        assert took < 2.0 and subscriber.gaps == 1 and subscriber.replayed >= 1
        assert routing.events.resyncs.get("e", 0) == 0  # replayed, never cleared
        # The engine restarts: its sequence starts again, its cache is empty.
        publisher._next_seq = 0
        publisher.publish(0.3, [_stored(0, 1)])
        await _until(lambda: subscriber.restarts == 1)
        await _until(lambda: routing.index.matched("e", HASHES) == 1)
        assert routing.events.resyncs["e"] == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await publisher.close()


async def test_without_replay_a_gap_clears_and_the_index_rebuilds() -> None:
    publisher = KVPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0"))
    publisher.start()
    policy, routing = _policy()
    subscriber = KVEventSubscriber("e", publisher.endpoint, policy.kv_events)
    task = asyncio.create_task(subscriber.run())
    try:
        await asyncio.sleep(0.3)
        publisher.publish(0.0, [_stored(0, 3)])
        await _until(lambda: routing.index.matched("e", HASHES) == 3)
        publisher._next_seq += 1  # a batch lost for good
        publisher.publish(0.1, [_stored(0, 1)])
        took = await _until(lambda: routing.events.resyncs.get("e", 0) == 1)
        assert took < 2.0
        # Cleared, then rebuilt from what followed: only the re-stored block is known.
        assert routing.index.matched("e", HASHES) == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await publisher.close()


async def test_the_gateway_shows_each_engines_event_stream(engine_factory, gateway_factory) -> None:
    """`/admin/state` shows, per engine with `kv_events`, what its stream brought: an
    operator asks it whether events arrive at all."""
    import httpx

    publisher = KVPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0"))
    publisher.start()
    engine = await engine_factory()
    try:
        gw = await gateway_factory(
            [engine.url],
            policy="adaptive",
            overrides={"backends": [{"url": engine.url, "kv_events": publisher.endpoint}]},
        )
        node = engine.url.removeprefix("http://")
        async with httpx.AsyncClient(base_url=gw.url) as client:

            async def stream() -> dict[str, object]:
                state = (await client.get("/admin/state")).json()
                return dict(state["kv_events"][node])

            deadline = time.monotonic() + 10.0
            seen = await stream()
            while not seen["batches"]:  # a SUB socket misses what is sent before it joins
                assert time.monotonic() < deadline, seen
                publisher.publish(time.time(), [_stored(0, 2)])
                await asyncio.sleep(0.05)
                seen = await stream()
        assert seen["endpoint"] == publisher.endpoint and seen["gaps"] == 0, seen
    finally:
        await publisher.close()
