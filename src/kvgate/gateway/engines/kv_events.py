"""The engines' KV events, subscribed to: the precise source of the prefix index.

A backend entry whose `kv_events` names the engine's ZMQ publisher
(`tcp://host:5557`, optionally `?replay=tcp://host:5558` for vLLM's replay socket) gets
one `KVEventSubscriber`: a SUB socket reading each batch (topic, sequence number,
msgpack payload: `kvgate.adapters.vllm_kv_events`) and handing it to the policy
(`kvgate.core.prefix.events.KVEventSink`), whose tracker maps the engine's block keys to
kvgate's (`kvgate.core.prefix.tracker`).

Resync:
- at start, and after a gap in the sequence (a batch lost: PUB drops past its high-water
  mark, a reconnect), the missing batches are asked of the replay socket and applied in
  order before the one that revealed the gap;
- without a replay socket, or when it no longer has them, the batch goes to the tracker
  as it is: it sees the gap, clears the engine's entry and rebuilds it from the events
  that follow (the engine is then ranked by headroom alone);
- a sequence that starts again (an engine restarted) is a gap the tracker clears on,
  as is vLLM's `AllBlocksCleared`.
A socket that delivers nothing is not an error (an idle engine publishes nothing).

Needs `pyzmq` and `msgspec` (the `kv-events` extra); without them a backend's
`kv_events` is refused at start with a message naming the extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from kvgate.core.prefix.events import KVEventBatch

log = logging.getLogger(__name__)

#: How long a replay may take before the gap is left to the tracker.
REPLAY_TIMEOUT_S = 0.5

Sink = Callable[[str, KVEventBatch], object]


def split_endpoint(url: str) -> tuple[str, str | None]:
    """`tcp://h:5557?replay=tcp://h:5558` as (publisher, replay or None); ValueError when
    it is not a tcp:// or ipc:// endpoint."""
    parts = urlsplit(url)
    if parts.scheme not in ("tcp", "ipc") or not (parts.netloc or parts.path):
        raise ValueError(f"{url!r} is not a ZMQ endpoint: expected tcp://host:port[?replay=...]")
    replay = parse_qs(parts.query).get("replay", [None])[0]
    if replay is not None:
        split_endpoint(replay)
    return parts._replace(query="").geturl(), replay


class KVEventSubscriber:
    """One engine's KV event stream into `sink(node_id, batch)`."""

    def __init__(self, node_id: str, url: str, sink: Sink) -> None:
        import zmq.asyncio  # the kv-events extra

        self.node_id = node_id
        self.endpoint, self.replay_endpoint = split_endpoint(url)
        self._sink = sink
        self._ctx = zmq.asyncio.Context()
        self.last_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.restarts = 0
        self.replayed = 0
        self._replayed_from: int | None = None

    async def run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            await self._replay(0, None)  # what the engine cached before we listened
            while True:
                frames = await sub.recv_multipart()
                if len(frames) < 3:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                last = self.last_seq
                if last is not None and seq <= last:
                    if self._replayed_from is not None and seq >= self._replayed_from:
                        continue  # replayed already
                    self.restarts += 1  # a sequence that starts again: the tracker clears
                elif last is not None and seq > last + 1:
                    self.gaps += 1
                    await self._replay(last + 1, seq)
                self._feed(seq, frames[-1])
        finally:
            sub.close(linger=0)
            self._ctx.term()

    def _feed(self, seq: int, payload: bytes) -> None:
        from kvgate.adapters.vllm_kv_events import WireError, decode_batch

        try:
            batch = decode_batch(payload, seq)
        except WireError as exc:
            log.warning("kv events of %s: %s", self.node_id, exc)
            return
        self.last_seq = seq
        self.batches += 1
        self._sink(self.node_id, batch)

    async def _replay(self, start: int, before: int | None) -> None:
        """Apply the buffered batches from `start` (up to `before`) from the replay socket."""
        if self.replay_endpoint is None:
            return
        import zmq

        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            self._replayed_from = start
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    return
                if before is not None and seq >= before:
                    continue
                if self.last_seq is None or seq > self.last_seq:
                    self.replayed += 1
                    self._feed(seq, frames[-1])
        except TimeoutError:
            log.info("kv events of %s: no replay from %s", self.node_id, self.replay_endpoint)
        finally:
            with contextlib.suppress(Exception):
                dealer.close(linger=0)

    def snapshot(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "replay": self.replay_endpoint,
            "last_seq": self.last_seq,
            "batches": self.batches,
            "gaps": self.gaps,
            "restarts": self.restarts,
            "replayed": self.replayed,
        }
