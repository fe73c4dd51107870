"""Engine samples shared between replicas: the ones to publish, the peers' to feed, and the
store's clock that carries their times across.

Each engine is scraped by one replica (see `kvgate.cluster.shards`); the others learn its
state from the store. A replica publishes, per engine it polled itself lately, a *record*:
its last good sample, how many scrapes failed since, and when it last tried, every time in
the store's clock (`ClockLink`, below). A reader feeds a record into its own policy
the way its scraper would: a newer sample through `observe` (its time mapped back to the
local clock), new failures through `observe_failure`, so the core cannot tell a shared
sample from one of its own scrapes.

Records come from other processes, possibly of another version: a record that does not
parse is skipped, never trusted.

**The store's clock.** A sample's `sampled_at` is on the monotonic clock of the process
that scraped it, which means nothing to another process, let alone another host. Every sync
tick brings back the store's own time (Redis `TIME`) and is bracketed by two readings of the
local clock, so `offset = store_time - midpoint` maps local time to store time with an error
of at most half the round trip. A sample travels in store time and is mapped back by each
reader (`ClockLink`).

The link keeps the best (shortest round trip) of its recent estimates, and errs on the
safe side: both directions subtract the uncertainty, so a sample can only look older than
it is, never younger (an older sample reflects fewer requests, so the core over-counts,
never under-counts). On loopback the round trip is a few hundred microseconds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields, replace
from typing import Any

from kvgate.core.clock import Clock
from kvgate.core.signals import NodeSample, SignalSink

#: An owner whose view was published longer ago than this stopped ticking (dead,
#: isolated, stalled): its engines are scraped locally again. Well inside the core's
#: `stale_after_s` (1 s by default), so a node stays fresh through a handover.
SHARED_FRESH_S = 0.5
#: First-hand records are published while their last attempt is this recent.
PUBLISH_FOR_S = 1.0
#: A reader feeds at most this many failures from one record at once.
_MAX_FAILURES_FED = 32

_SAMPLE_FIELDS = tuple(f.name for f in fields(NodeSample))
# Recent exchanges the clock link keeps, to take the one with the shortest round trip.
_WINDOW = 16


class ClockLink:
    """Local time <-> store time, from the exchanges' round trips (see the module docstring)."""

    def __init__(self) -> None:
        self._estimates: deque[tuple[float, float]] = deque(maxlen=_WINDOW)  # (half-rtt, off)
        self._offset: float | None = None
        self._uncertainty = 0.0

    @property
    def known(self) -> bool:
        return self._offset is not None

    @property
    def uncertainty_s(self) -> float:
        return self._uncertainty

    def observe(self, sent_at: float, received_at: float, store_time: float) -> None:
        """One exchange: sent and answered at these local instants, run at `store_time`."""
        half = max(0.0, received_at - sent_at) / 2
        self._estimates.append((half, store_time - (sent_at + half)))
        self._uncertainty, self._offset = min(self._estimates)

    def to_store(self, local: float) -> float:
        if self._offset is None:
            raise RuntimeError("no exchange yet: the store's clock is unknown")
        return local + self._offset - self._uncertainty

    def to_local(self, store: float) -> float:
        if self._offset is None:
            raise RuntimeError("no exchange yet: the store's clock is unknown")
        return store - self._offset - self._uncertainty


@dataclass(slots=True)
class Record:
    """One engine as its publisher last saw it; times on the store's clock."""

    attempt_at: float
    failures: int  # consecutive hard failures (refused, reset, bad page) after `sample`
    sample: NodeSample | None  # the last good one (None: none yet)
    soft_failures: int = 0  # and polls abandoned unanswered (a busy engine, not a dead one)

    def to_json(self) -> dict[str, Any]:
        sample = self.sample
        return {
            "at": self.attempt_at,
            "fails": self.failures,
            "soft": self.soft_failures,
            "sample": None if sample is None else {f: getattr(sample, f) for f in _SAMPLE_FIELDS},
        }

    @classmethod
    def from_json(cls, data: Any) -> Record | None:
        """The record, or None when `data` is not one."""
        try:
            at = float(data["at"])
            fails = int(data["fails"])
            soft = int(data.get("soft", 0))
            raw = data["sample"]
            sample = (
                None
                if raw is None
                else NodeSample(**{f: raw[f] for f in _SAMPLE_FIELDS if f in raw})
            )
        except (TypeError, ValueError, KeyError):
            return None
        if not math.isfinite(at) or fails < 0 or soft < 0:
            return None
        if sample is not None and not isinstance(sample.sampled_at, int | float):
            return None
        return cls(at, fails, sample, soft)


@dataclass(slots=True)
class _Local:
    attempt_at: float  # local clock
    failures: int
    sample: NodeSample | None
    soft_failures: int = 0


class SampleLedger:
    """This replica's first-hand records, and what it has fed from its peers'."""

    def __init__(self) -> None:
        self._local: dict[str, _Local] = {}
        # node -> (store time of the peer sample fed last, hard and soft failures fed since)
        self._fed: dict[str, tuple[float | None, int, int]] = {}

    # ---- first hand -------------------------------------------------------------------

    def record_sample(self, node_id: str, sample: NodeSample, now: float) -> None:
        self._local[node_id] = _Local(now, 0, sample)

    def record_failure(self, node_id: str, now: float, hard: bool = True) -> None:
        entry = self._local.get(node_id)
        if entry is None:
            entry = self._local[node_id] = _Local(now, 0, None)
        entry.attempt_at = now
        if hard:
            entry.failures += 1
        else:
            entry.soft_failures += 1

    def records(self, now: float, link: ClockLink) -> dict[str, dict[str, Any]]:
        """The JSON of every recent first-hand record, in store time."""
        out: dict[str, dict[str, Any]] = {}
        for node_id, entry in self._local.items():
            if now - entry.attempt_at > PUBLISH_FOR_S:
                continue
            sample = entry.sample
            if sample is not None:
                sample = replace(sample, sampled_at=link.to_store(sample.sampled_at))
            at = link.to_store(entry.attempt_at)
            out[node_id] = Record(at, entry.failures, sample, entry.soft_failures).to_json()
        return out

    def keep_only(self, node_ids: set[str]) -> None:
        """Forget engines that are no longer served."""
        for table in (self._local, self._fed):
            for node_id in [n for n in table if n not in node_ids]:
                del table[node_id]

    # ---- from peers ---------------------------------------------------------------------

    def feed(self, node_id: str, record: Record, link: ClockLink, sink: SignalSink) -> None:
        """Tell `sink` what `record` adds to what was fed before: a newer sample, then the
        failures counted after it (hard and soft, as the scraper tells them)."""
        fed_at, fed_hard, fed_soft = self._fed.get(node_id, (None, 0, 0))
        sample = record.sample
        at = None if sample is None else sample.sampled_at
        if sample is not None and at is not None and (fed_at is None or at > fed_at):
            sink.observe(node_id, replace(sample, sampled_at=link.to_local(at)))
            fed_at, fed_hard, fed_soft = at, 0, 0
        if at == fed_at:
            for _ in range(min(record.failures - fed_hard, _MAX_FAILURES_FED)):
                sink.observe_failure(node_id, True)
            for _ in range(min(record.soft_failures - fed_soft, _MAX_FAILURES_FED)):
                sink.observe_failure(node_id, False)
            fed_hard = max(fed_hard, record.failures)
            fed_soft = max(fed_soft, record.soft_failures)
        self._fed[node_id] = (fed_at, fed_hard, fed_soft)


class SharingSink:
    """What the scraper feeds when replicas share samples: the policy, and the ledger that
    publishes them."""

    def __init__(self, sink: SignalSink, ledger: SampleLedger, clock: Clock) -> None:
        self._sink = sink
        self._ledger = ledger
        self._clock = clock

    def observe(self, node_id: str, sample: NodeSample) -> None:
        self._ledger.record_sample(node_id, sample, self._clock.now())
        self._sink.observe(node_id, sample)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        self._ledger.record_failure(node_id, self._clock.now(), hard)
        self._sink.observe_failure(node_id, hard)
