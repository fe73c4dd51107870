"""Each engine's KV events, in virtual time, to the replicas' indexes: the two ways they go.

An engine's step that changed its cache is one numbered batch (`KVEventBatch`). It reaches
every replica's policy that takes events (`KVEventSink`) in one of two ways
(`VirtualConfig.kv_events_via`):

- `subscribe`: every replica subscribes to every engine's publisher and applies each batch
  as it is published (the ZMQ fan-out; its delivery takes well under a millisecond);
- `views`: only the engine's *owner* (replica `node % gateways`) subscribes; the others
  learn the batch through the owner's view: the owner's next sync after the batch carries
  it to the store (`store_latency_s / 2`), and a reader takes it at its first exchange at
  the store after that, `store_latency_s / 2` back (`view_delivery`). Replica `g` syncs at
  `g * sync_interval_s / gateways` and every `sync_interval_s` after, as the runner
  schedules it, so the staleness a view adds is what these phases make it: between the
  store latency and two sync intervals.

An observer (`VirtualCluster`'s `kv_sink`) gets every batch as it is published.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from kvgate.core.prefix.events import KVEvent, KVEventBatch

#: How a replica's policy takes one engine's batch: `(node_id, batch)`.
Sink = Callable[[str, KVEventBatch], object]
#: How the runner delivers a batch later: `(when, sink, node_id, batch)`.
Schedule = Callable[[float, Sink, str, KVEventBatch], None]
KVEventsVia = Literal["subscribe", "views"]


def next_sync(t: float, phase: float, interval: float) -> float:
    """The first sync time `phase + k * interval` (k >= 0) at or after `t`."""
    if t <= phase:
        return phase
    return phase + math.ceil((t - phase) / interval - 1e-12) * interval


def view_delivery(
    published: float, owner: int, reader: int, gateways: int, interval: float, latency: float
) -> float:
    """When a batch published at `published` reaches replica `reader` through replica
    `owner`'s view (see the module docstring)."""
    step = interval / gateways
    sent = next_sync(published, owner * step, interval)
    # The reader's exchange must come after the owner's at the store; their phases differ.
    taken = next_sync(sent, reader * step, interval)
    if taken == sent:
        taken += interval
    return taken + latency


class KVFanOut:
    """Numbers each engine's batches and hands them to the replicas' sinks and the observer."""

    __slots__ = ("_gateways", "_interval", "_latency", "_observer", "_schedule", "_seq",
                 "_sinks", "_via")  # fmt: skip

    def __init__(
        self,
        nodes: int,
        sinks: Sequence[Sink | None],
        observer: Sink | None,
        schedule: Schedule,
        via: KVEventsVia = "subscribe",
        sync: tuple[float, float] | None = None,
    ) -> None:
        """`sinks[g]`: replica g's (None: it takes no events); `sync`: the views'
        `(interval, store latency)`, which `via="views"` needs."""
        if via == "views" and sync is None:
            raise ValueError("KV events through views need the replicas' sync interval")
        self._sinks = list(sinks)
        self._gateways = len(self._sinks)
        self._observer = observer
        self._schedule = schedule
        self._via = via
        self._interval, self._latency = sync or (0.0, 0.0)
        self._seq = [0] * nodes

    @property
    def active(self) -> bool:
        """Whether anyone takes the events."""
        return self._observer is not None or any(s is not None for s in self._sinks)

    def publish(self, node: int, node_id: str, now: float, events: Sequence[KVEvent]) -> None:
        """Engine `node`'s step at `now` produced `events`."""
        seq = self._seq[node]
        self._seq[node] = seq + 1
        batch = KVEventBatch(now, tuple(events), seq)
        owner = node % self._gateways
        for g, sink in enumerate(self._sinks):
            if sink is None:
                continue
            if self._via == "subscribe" or g == owner:
                sink(node_id, batch)
            else:
                when = view_delivery(now, owner, g, self._gateways, self._interval, self._latency)
                self._schedule(when, sink, node_id, batch)
        if self._observer is not None:
            self._observer(node_id, batch)
