"""What one replica publishes in the store each tick (`Publication`), as one JSON blob.

    {"v": 1,
     "core": {...},        # the core's view (`PeerView.to_json`, kvgate.core.replicas.view)
     "samples": {...},     # engine id -> record (kvgate.cluster.samples), first hand
     "meta": {...}}        # host, pid, state and which engines it scrapes: for operators;
                           # "agreed": the settings every replica must have alike

A blob that is not valid JSON of this version is ignored (that member still counts as a
member: its holds are unknown, not absent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.cluster.samples import Record
from kvgate.core.settings import AdmissionSettings

VERSION = 1


def agreed(settings: AdmissionSettings) -> dict[str, float]:
    """The admission settings replicas that share a store must have alike: they size each
    node's slack and each request's footprint, which every replica's claims are parts of
    (a replica with a higher ceiling claims room the others plan as full)."""
    return {
        "high_watermark": settings.high_watermark,
        "panic_watermark": settings.panic_watermark,
        "stale_after_s": settings.stale_after_s,
        "reservation_overhead_tokens": settings.tuning.reservation_overhead_tokens,
    }


@dataclass(frozen=True, slots=True)
class Publication:
    """One replica's blob: the core's view, its first-hand engine records, facts for
    operators. `core` stays JSON until the sync reads it (`PeerView.from_json`)."""

    core: dict[str, Any]
    samples: dict[str, Any]  # raw JSON records, parsed on demand
    meta: dict[str, Any]

    def encode(self) -> bytes:
        return orjson.dumps(
            {"v": VERSION, "core": self.core, "samples": self.samples, "meta": self.meta},
            option=orjson.OPT_NON_STR_KEYS,
        )

    def record(self, node_id: str) -> Record | None:
        raw = self.samples.get(node_id)
        return None if raw is None else Record.from_json(raw)


def decode(blob: bytes) -> Publication | None:
    """The publication in `blob`, or None when it is not one this version can read."""
    try:
        data = orjson.loads(blob)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("v") != VERSION:
        return None
    core, samples, meta = data.get("core"), data.get("samples"), data.get("meta")
    if not (isinstance(core, dict) and isinstance(samples, dict) and isinstance(meta, dict)):
        return None
    return Publication(core, samples, meta)
