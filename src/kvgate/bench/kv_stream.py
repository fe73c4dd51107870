"""The engines' KV event streams, measured: what subscribing costs and what a view would carry.

Two ways for every replica to know each engine's cache (`kvgate.sim.kv_fanout`): each
replica subscribes to every engine's publisher and decodes every batch itself, or the
engine's owner alone subscribes and its view carries, every sync, the change of its index
since the last one. `StreamMeter` (a `VirtualCluster` `kv_sink`) measures both on a run:

- the stream as published: batches, events, block hashes stored and removed, and its
  bytes in vLLM's wire format (`kvgate.adapters.vllm_kv_events`: the msgpack payload plus
  the topic and the 8-byte sequence frame), per engine per second;
- what a view would carry per sync: per engine and per sync interval, the net change of
  the engine's cached blocks (a block stored then removed within the interval, or removed
  then stored, is no change), as kvgate block hashes, and its JSON size
  (`{"+": [hash, ...], "-": [hash, ...]}` per engine).

It keeps every engine's payloads and deltas so that `decode_cost` can time, on the
busiest engine's (`busiest`), per batch, what
a subscriber pays (`decode_batch` and `PrefixRouting.kv_events`: the tracker rehashes the
stored blocks' token ids) against what a view's reader pays (parsing the delta's JSON and
applying it to the index).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from kvgate.adapters.vllm_kv_events import decode_batch, encode_batch
from kvgate.core.policies.routing import PrefixRouting
from kvgate.core.prefix.events import BlockRemoved, BlockStored, EngineBlockHash, KVEventBatch
from kvgate.core.prefix.held import PromptBlocks
from kvgate.core.prefix.index import PrefixIndex

#: The ZMQ frames around a payload: the topic (empty, as vLLM's default) and the sequence.
FRAME_BYTES = 8
#: Delta: net change of a block per interval (+1 stored, -1 removed).
_Delta = dict[int, int]


def _key(h: EngineBlockHash) -> int:
    """A block's hash as an int (the simulated engines publish kvgate's, as 8 bytes)."""
    return int.from_bytes(h, "big", signed=True) if isinstance(h, bytes) else h


@dataclass
class _Engine:
    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    bytes: int = 0
    window: int = -1
    delta: _Delta = field(default_factory=dict)
    # Per closed sync interval: (net hashes, JSON bytes), the empty ones too.
    deltas: list[tuple[int, int]] = field(default_factory=list)


class StreamMeter:
    """A `kv_sink` measuring every engine's stream (see the module docstring)."""

    def __init__(self, sync_interval_s: float) -> None:
        self.interval = sync_interval_s
        self.engines: dict[str, _Engine] = {}
        self.payloads: dict[str, list[bytes]] = {}
        self.delta_texts: dict[str, list[bytes]] = {}
        self.first: float | None = None
        self.last = 0.0

    def __call__(self, node_id: str, batch: KVEventBatch) -> None:
        e = self.engines.get(node_id)
        if e is None:
            e = self.engines[node_id] = _Engine()
        if self.first is None:
            self.first = batch.ts
        self.last = max(self.last, batch.ts)
        window = int(batch.ts / self.interval)
        if e.window < 0:
            e.window = window
        while e.window < window:
            self._close(node_id, e)
        payload = encode_batch(batch)
        self.payloads.setdefault(node_id, []).append(payload)
        e.batches += 1
        e.events += len(batch.events)
        e.bytes += len(payload) + FRAME_BYTES
        delta = e.delta
        for event in batch.events:
            if isinstance(event, BlockStored):
                e.stored += len(event.block_hashes)
                for h in map(_key, event.block_hashes):
                    if delta.get(h) == -1:
                        del delta[h]
                    else:
                        delta[h] = 1
            elif isinstance(event, BlockRemoved):
                e.removed += len(event.block_hashes)
                for h in map(_key, event.block_hashes):
                    if delta.get(h) == 1:
                        del delta[h]
                    else:
                        delta[h] = -1

    def _close(self, node_id: str, e: _Engine) -> None:
        delta = e.delta
        text = _delta_json(delta)
        e.deltas.append((len(delta), len(text)))
        if delta:
            self.delta_texts.setdefault(node_id, []).append(text)
        e.delta = {}
        e.window += 1

    def finish(self) -> None:
        """Close every engine's last interval."""
        for node_id, e in self.engines.items():
            if e.delta:
                self._close(node_id, e)

    def busiest(self) -> str:
        """The engine that published the most batches."""
        return max(self.engines, key=lambda n: self.engines[n].batches)

    def summary(self) -> dict[str, Any]:
        """Per engine and second (means over the engines that published; `all_*`: summed
        over them) and per sync (mean, p99, max)."""
        span = max(1e-9, self.last - (self.first or 0.0))
        engines = list(self.engines.values())
        n = max(1, len(engines))

        def per_s(attr: str) -> float:
            total: float = sum(getattr(e, attr) for e in engines)
            return total / n / span

        deltas = sorted(d for e in engines for d in e.deltas)
        sizes = sorted(b for e in engines for _, b in e.deltas)
        stored = sum(e.stored for e in engines)
        return {
            "span_s": span,
            "engines": len(engines),
            "batches_per_s": per_s("batches"),
            "events_per_s": per_s("events"),
            "stored_hashes_per_s": per_s("stored"),
            "removed_hashes_per_s": per_s("removed"),
            "bytes_per_s": per_s("bytes"),
            "all_batches_per_s": per_s("batches") * n,
            "all_bytes_per_s": per_s("bytes") * n,
            "all_stored_hashes_per_s": per_s("stored") * n,
            "bytes_per_stored_block": sum(e.bytes for e in engines) / max(1, stored),
            "sync_interval_s": self.interval,
            "delta_hashes_mean": sum(h for h, _ in deltas) / max(1, len(deltas)),
            "delta_hashes_p99": _pct([h for h, _ in deltas], 0.99),
            "delta_hashes_max": max((h for h, _ in deltas), default=0),
            "delta_json_bytes_mean": sum(sizes) / max(1, len(sizes)),
            "delta_json_bytes_p99": _pct(sizes, 0.99),
        }


def _delta_json(delta: _Delta) -> bytes:
    plus = [h for h, d in delta.items() if d > 0]
    minus = [h for h, d in delta.items() if d < 0]
    return json.dumps({"+": plus, "-": minus}, separators=(",", ":")).encode()


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def decode_cost(
    payloads: Sequence[bytes], deltas: Sequence[bytes], capacity_blocks: int, repeat: int = 3
) -> dict[str, float]:
    """Microseconds per batch (and per stored block) a subscriber spends decoding and
    applying one engine's `payloads`, and per delta a view's reader spends on `deltas`;
    the median of `repeat` passes, each on a fresh index of `capacity_blocks`."""
    batches = [decode_batch(p, seq) for seq, p in enumerate(payloads)]
    stored = sum(
        len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockStored)
    )
    events = sum(len(b.events) for b in batches)
    decode, apply, view = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for seq, p in enumerate(payloads):
            decode_batch(p, seq)
        decode.append(time.perf_counter() - t0)
        routing = PrefixRouting({}, PromptBlocks())
        routing.index.resize("n", capacity_blocks)
        t0 = time.perf_counter()
        for b in batches:
            routing.kv_events("n", b)
        apply.append(time.perf_counter() - t0)
        index = PrefixIndex()
        index.resize("n", capacity_blocks)
        t0 = time.perf_counter()
        for text in deltas:
            d = json.loads(text)
            index.store("n", d["+"])
            index.remove("n", d["-"])
        view.append(time.perf_counter() - t0)
    nb = max(1, len(payloads))
    return {
        "batches": len(payloads),
        "events": events,
        "stored_blocks": stored,
        "decode_us_per_batch": median(decode) / nb * 1e6,
        "apply_us_per_batch": median(apply) / nb * 1e6,
        "subscribe_us_per_batch": (median(decode) + median(apply)) / nb * 1e6,
        "subscribe_us_per_event": (median(decode) + median(apply)) / max(1, events) * 1e6,
        "subscribe_us_per_stored_block": (median(decode) + median(apply)) / max(1, stored) * 1e6,
        "deltas": len(deltas),
        "view_us_per_delta": median(view) / max(1, len(deltas)) * 1e6,
        "view_us_total": median(view) * 1e6,
        "subscribe_us_total": (median(decode) + median(apply)) * 1e6,
    }
