"""The live simulator with prefix caching publishes its KV events over ZMQ as vLLM does:
topic, consecutive sequence numbers, vLLM's payload; the replay socket resends from a
sequence number and ends with vLLM's end marker; the metrics page counts the hits."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import zmq
import zmq.asyncio

from kvgate.adapters.vllm_kv_events import END_SEQ, decode_batch
from kvgate.core.prefix.events import AllBlocksCleared, BlockStored, KVEventBatch
from kvgate.sim.kv_publisher import KVEventsConfig, KVPublisher
from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY
from kvgate.sim.server import SimServer

pytestmark = pytest.mark.timeout(60)
PREFIX = list(range(1000, 1320))  # 10 blocks of 32


def test_the_flag_takes_vllms_json_and_moves_ports_per_engine() -> None:
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": false}') is None
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv"}'
    )
    assert config is not None and config.topic == "kv"
    assert config.for_engine(2).endpoint == "tcp://*:5559"
    assert config.for_engine(2).replay_endpoint == "tcp://*:5560"
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "x"}')


async def test_a_taken_endpoint_is_an_os_error_naming_it() -> None:
    first = KVPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:0"))
    first.start()
    try:
        second = KVPublisher(KVEventsConfig(endpoint=first.endpoint))
        with pytest.raises(OSError, match=first.endpoint):
            second.start()
        await second.close()
    finally:
        await first.close()


async def _batches(sub: zmq.asyncio.Socket, until: int) -> list[tuple[bytes, int, KVEventBatch]]:
    out = []
    while len(out) < until:
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
        number = int.from_bytes(seq, "big")
        out.append((topic, number, decode_batch(payload, number)))
    return out


async def _joined(sub: zmq.asyncio.Socket, http: httpx.AsyncClient) -> int:
    """Reset the (empty) cache until `sub` receives the `AllBlocksCleared` batch that
    publishes (a SUB socket misses what is sent before it has joined); the next sequence
    number."""
    while True:
        assert (await http.post("/reset_prefix_cache")).json() == {"reset": True}
        if await sub.poll(200):
            _, seq, payload = await sub.recv_multipart()
            assert decode_batch(payload).events == (AllBlocksCleared(),)
            return int.from_bytes(seq, "big") + 1


async def test_events_are_published_replayed_and_the_hits_counted() -> None:
    config = KVEventsConfig(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
    )
    publisher = KVPublisher(config)
    engine = Engine(dataclasses.replace(CPU_TINY, enable_prefix_caching=True),
                    record_kv_events=True)  # fmt: skip
    sim = SimServer(engine, kv_publisher=publisher)
    port = await sim.start()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
            n = await _joined(sub, http)
            for tail in ([1, 2, 3], [4, 5, 6]):
                body = {"model": "sim-llama", "prompt": PREFIX + tail, "max_tokens": 4,
                        "ignore_eos": True}  # fmt: skip
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            # The first request stores the prefix's 10 blocks; the second reuses them and
            # fills no new block (its last 3 tokens and 4 outputs stay in a partial one).
            got = await _batches(sub, 1)
            page = (await http.get("/metrics")).text
            assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-llama"} 320.0' in page
            assert "vllm:prefix_cache_queries_total{" in page and "enable_prefix_caching" in page
            assert (await http.post("/reset_prefix_cache")).json() == {"reset": True}
            (cleared,) = await _batches(sub, 1)
        assert all(topic == b"kv" for topic, _, _ in got)
        assert [number for _, number, _ in got] == [n]
        first = got[0][2].events[0]
        assert isinstance(first, BlockStored) and first.parent_block_hash is None
        assert list(first.token_ids) == PREFIX and len(first.block_hashes) == 10
        assert cleared[1] == n + 1 and cleared[2].events == (AllBlocksCleared(),)
        # The replay socket resends from a sequence number on, then the end marker.
        assert publisher.replay_endpoint is not None
        req = ctx.socket(zmq.DEALER)
        req.connect(publisher.replay_endpoint)
        await req.send_multipart((b"", n.to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = await asyncio.wait_for(req.recv_multipart(), 10)
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            replayed.append(int.from_bytes(seq, "big"))
        assert replayed == [n, n + 1]
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
        await sim.close()
