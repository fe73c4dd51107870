"""The dashboard's history: the last minutes of what its charts draw, kept by the gateway,
so that a tab opened during an incident shows how it began.

`ChartHistory` keeps one point a second (`EVERY_S`) of the last five minutes (`WINDOW_S`,
the dashboard's longest window) in a ring. A point is the part of the gateway's state the
charts are drawn from (`chart_point`), in the state's own shape so that the page reads it
as it reads a live state: the admission, Retry-After and cancellation counters, the queue's
bands, the in-flight tokens and the panic watermark, and each node's reported and
predicted KV usage. Points are kept encoded: 0.7 KB with 2 nodes, 8 KB with 64 (2.4 MB
for the five minutes).

A dashboard that connects gets them first, as one `history` event, `{"now": <the gateway's
clock>, "points": [...]}`: the page places each point `now - time` seconds before its own
clock, so the two clocks need not agree. Every live event carries the state's time as its
SSE id; a page that reconnects sends the last one it saw (`Last-Event-ID`) and gets only
the points after it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import orjson

log = logging.getLogger(__name__)

#: Seconds between two points, and how far back the ring reaches.
EVERY_S = 1.0
WINDOW_S = 300.0

_COUNTERS = ("admissions", "retry_after_count", "retry_after_sum_s", "cancellations")


def chart_point(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the dashboard's charts need of one `/admin/state`, in the same shape."""
    policy = state.get("policy") or {}
    controller = policy.get("controller") or {}
    bands = (policy.get("queue") or {}).get("bands") or {}
    counters = state.get("gateway") or {}
    nodes = {}
    for node_id, node in (policy.get("nodes") or {}).items():
        sample = node.get("sample") or {}
        nodes[node_id] = {
            "sample": {"kv_usage": sample.get("kv_usage")},
            "predicted_usage": node.get("predicted_usage"),
            "fresh": node.get("fresh"),
            "state": node.get("state"),
        }
    return {
        "time": state.get("time"),
        "policy": {
            "controller": {
                "in_flight_tokens": controller.get("in_flight_tokens"),
                "panic_watermark": controller.get("panic_watermark"),
            },
            "queue": {
                "bands": {
                    name: {"waiting": band.get("waiting"), "oldest_s": band.get("oldest_s")}
                    for name, band in bands.items()
                }
            },
            "nodes": nodes,
        },
        "gateway": {key: counters.get(key) for key in _COUNTERS},
    }


class ChartHistory:
    """The ring of chart points (see the module docstring)."""

    def __init__(
        self,
        state_provider: Callable[[], Mapping[str, Any]],
        *,
        every_s: float = EVERY_S,
        window_s: float = WINDOW_S,
    ) -> None:
        self.state_provider = state_provider
        self.every_s = every_s
        self._points: deque[tuple[float, bytes]] = deque(maxlen=max(1, int(window_s / every_s)))

    def __len__(self) -> int:
        return len(self._points)

    def record(self, state: Mapping[str, Any]) -> None:
        """Keep the chart point of `state` (one whose `time` is not a number is skipped)."""
        at = state.get("time")
        if isinstance(at, int | float) and math.isfinite(at):
            self._points.append((float(at), orjson.dumps(chart_point(state))))

    async def run(self) -> None:
        """Record a point every `every_s` until cancelled."""
        while True:
            try:
                self.record(self.state_provider())
            except Exception:  # the history must not die of a bug elsewhere
                log.exception("the dashboard's history could not read the state")
            await asyncio.sleep(self.every_s)

    def event(self, now: float, after: float | None = None) -> bytes:
        """The SSE `history` event: the points later than `after` (all when None)."""
        points = [data for at, data in self._points if after is None or at > after]
        now_json = orjson.dumps(now)
        return (
            b'event: history\ndata: {"now":'
            + now_json
            + b',"points":['
            + b",".join(points)
            + b"]}\n\n"
        )


def last_event_id(headers: Any) -> float | None:
    """The `Last-Event-ID` a reconnecting EventSource sends: the time of the last state it
    saw (None when absent or not a number)."""
    for name, value in headers:
        if name == b"last-event-id":
            try:
                seen = float(value.decode("latin-1"))
            except ValueError:
                return None
            return seen if math.isfinite(seen) else None
    return None
