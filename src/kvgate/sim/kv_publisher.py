"""The live simulator's KV event publisher: vLLM's ZMQ sockets, fed by the engine's steps.

`kvgate sim --enable-prefix-caching --kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657",
"topic": "kv"}'` takes vLLM's flag and keys (`endpoint`, `replay_endpoint`,
`buffer_steps`, `hwm`, `topic`). Each engine step that changed the cache is published as
one batch, in vLLM's wire format (`kvgate.adapters.vllm_kv_events`): topic, sequence
number, payload, with the batch's wall-clock time. The last `buffer_steps` batches are
kept for the replay socket. Engine `i` of `--nodes N` adds `i` to both ports, as vLLM does
for its data-parallel ranks. The simulator binds every endpoint (vLLM connects to one
without a wildcard).

Needs `pyzmq` and `msgspec` (the `kv-events` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvgate.adapters.vllm_kv_events import END_SEQ, encode_batch, seq_frame
from kvgate.core.prefix.events import KVEvent, KVEventBatch

_KEYS = frozenset({"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
                   "buffer_steps", "hwm", "max_queue_size", "topic"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`, the keys the simulator uses."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig | None:
        """The config vLLM's flag gives (None: events off). Raises ValueError."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict) or not set(raw) <= _KEYS:
            unknown = sorted(set(raw) - _KEYS) if isinstance(raw, dict) else raw
            raise ValueError(f"--kv-events-config: unknown keys {unknown}")
        if not raw.get("enable_kv_cache_events", False) or raw.get("publisher") == "null":
            return None
        if raw.get("publisher", "zmq") != "zmq":
            raise ValueError("--kv-events-config: publisher must be zmq or null")
        fields = {k: raw[k] for k in ("endpoint", "replay_endpoint", "buffer_steps", "hwm",
                                      "topic") if k in raw}  # fmt: skip
        return cls(**fields)

    def check(self, engines: int) -> None:
        """Refuse endpoints whose ports would collide across `engines` engines (each adds
        its index to both). Raises ValueError."""
        if self.replay_endpoint is None or engines < 2:
            return
        a, b = _port(self.endpoint), _port(self.replay_endpoint)
        if a and b and abs(a - b) < engines:
            raise ValueError(
                f"--kv-events-config: engine i publishes on port {a} + i and replays on "
                f"{b} + i: with {engines} engines the ports collide; keep them "
                f">= {engines} apart"
            )

    def for_engine(self, index: int) -> KVEventsConfig:
        """Engine `index`'s endpoints: both ports moved up by `index`."""
        return dataclasses.replace(
            self,
            endpoint=_offset(self.endpoint, index),
            replay_endpoint=_offset(self.replay_endpoint, index) if self.replay_endpoint else None,
        )


def _port(endpoint: str) -> int:
    """The endpoint's TCP port (0: none, or any)."""
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _offset(endpoint: str, index: int) -> str:
    head, sep, port = endpoint.rpartition(":")
    if not index or not sep or not port.isdigit() or port == "0":
        return endpoint
    return f"{head}:{int(port) + index}"


class KVPublisher:
    """One engine's publisher: `start()` binds, `publish()` sends a step's events."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint

    def start(self) -> None:
        self._pub.set_hwm(self.config.hwm)
        self.endpoint = _bind(self._pub, self.config.endpoint)
        if self.config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, self.config.replay_endpoint)
            self._task = asyncio.create_task(self._serve_replay(), name="kv-replay")

    def publish(self, ts: float, events: list[KVEvent]) -> int:
        """Send one batch; returns its sequence number."""
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(KVEventBatch(ts, tuple(events), seq))
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # past the high-water mark PUB drops, as vLLM's
            self._pub.send_multipart((self._topic, seq_frame(seq), payload), flags=zmq.NOBLOCK)
        return seq

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart((client, b"", self._topic, seq_frame(seq), payload))
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _bind(socket: Any, endpoint: str) -> str:
    """Bind `endpoint` (`tcp://*:0`: any free port) and return the endpoint bound. Raises
    OSError."""
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, exc.strerror) from None  # it names the address
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return str(bound).replace("0.0.0.0", "127.0.0.1")
