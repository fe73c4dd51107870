"""A synthetic `/admin/state` source, for dashboard tests that need many nodes.

Simulating 64 real engines on a 2-core machine would measure the machine, not the page; this
generator produces the same JSON shape the gateway serves, with an overload that can be
switched on and nodes that can be made stale, and `serve()` runs it behind the *real*
dashboard routes on uvicorn.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import uvicorn

from kvgate.gateway.ops import dashboard
from kvgate.gateway.ops.history import ChartHistory
from kvgate.gateway.ops.tenants import COLUMNS

PRIORITIES = ("critical", "standard", "sheddable")


class SyntheticCluster:
    """State that evolves with wall time: counters only grow, overload raises KV usage."""

    def __init__(self, nodes: int, seed: int = 7) -> None:
        self.ids = [f"node-{i:02d}" for i in range(nodes)]
        self.rng = random.Random(seed)
        self.overload = False
        self.stale: set[str] = set()
        self.full_page: set[str] = set()  # polled on the full page (the check said no)
        self.started = time.monotonic()
        self.last = self.started
        self.admitted = dict.fromkeys(PRIORITIES, 0.0)
        self.rejected: dict[str, dict[str, float]] = {p: {} for p in PRIORITIES}
        self.retry_count = 0.0
        self.retry_sum = 0.0
        self.cancellations = 0.0
        self.queued = 0.0
        self.lock = threading.Lock()

    def state(self) -> dict[str, Any]:
        with self.lock:
            now = time.monotonic()
            dt, self.last = now - self.last, now
            self._advance(dt)
            return self._snapshot(now)

    def history(self, seconds: int) -> ChartHistory:
        """A gateway's chart history of the `seconds` before now, a point a second, as if
        this cluster had run all that time (the states that follow continue it)."""
        history = ChartHistory(self.state)
        with self.lock:
            now = time.monotonic()
            for ago in range(seconds, 0, -1):
                self._advance(1.0)
                history.record(self._snapshot(now - ago))
            self.last = now
        return history

    def _advance(self, dt: float) -> None:
        base = {"critical": 5.0, "standard": 30.0, "sheddable": 15.0}
        for p in PRIORITIES:
            demand = base[p] * (3.0 if self.overload else 1.0)
            admit = demand if not self.overload else base[p] * (1.0 if p != "sheddable" else 0.2)
            self.admitted[p] += admit * dt
            shed = max(0.0, demand - admit)
            if shed:
                reason = "kv_planned_peak" if p != "critical" else "kv_panic"
                self.rejected[p][reason] = self.rejected[p].get(reason, 0.0) + shed * dt
                self.retry_count += shed * dt
                self.retry_sum += shed * dt * (2.0 if p == "sheddable" else 1.0)
        self.cancellations += (4.0 if self.overload else 0.5) * dt
        self.queued += (20.0 if self.overload else 0.0) * dt

    def _snapshot(self, now: float) -> dict[str, Any]:
        t = now - self.started
        level = 0.9 if self.overload else 0.45
        nodes = {}
        for i, node in enumerate(self.ids):
            wobble = 0.05 * math.sin(t * 0.7 + i)
            predicted = min(1.0, level + wobble + 0.05)
            stale = node in self.stale
            sample = {
                "kv_usage": min(1.0, level + wobble),
                "kv_capacity_tokens": 65536,
                "running": 12 + i % 5,
                "waiting": (8 + i % 7) if self.overload else 0,
                "iteration_latency_s": 0.03 + (0.02 if self.overload else 0.0),
                "sampled_at": now - (5.0 if stale else 0.05),
            }
            state = "stale" if stale else ("high" if predicted > 0.8 else "ok")
            margin = 0.04 if self.overload and not stale else 0.0
            nodes[node] = {
                "fresh": not stale,
                "age_s": 5.0 if stale else 0.05,
                "state": state,
                "sample": sample,
                "step_s": sample["iteration_latency_s"],
                "reserved_tokens": int(predicted * 65536 * 0.3),
                "in_flight": 12 + i % 5,
                "predicted_usage": predicted,
                "margin": margin,
                "peak_usage": min(0.92, predicted + 0.02),
                "ceiling": 0.92 if i % 2 else 3.92,
                "ceiling_reason": "recompute" if i % 2 else "overbooking",
                "prefix_hit_rate_seen": 0.83,
                "prefix_hit_rate_predicted": 0.9,
                "prefix_index_blocks": 4096 + i,
                "prefix_resyncs": i % 2,
            }
        # The gateway's shape: the flow controller's snapshot (the policy's, with the queue
        # and the tenants) nested under "policy", its own counters under "gateway", the
        # scraper's stats under "scraper".
        policy = {
            "policy": "adaptive",
            "time": now,
            "nodes": nodes,
            "controller": {
                "in_flight_tokens": 880_000 if self.overload else 420_000,
                "high_watermark": 0.8,
                "panic_watermark": 0.92,
                "feedback": True,
                "margins": {node: entry["margin"] for node, entry in nodes.items()},
            },
            "in_flight_requests": 14 * len(self.ids),
            "released_tokens_per_s": 25_000.0,
            "expected_output": {"sim-llama": 180},
            "queue": self._queue(),
            "tenants": {},
            "refused_peak": (
                {
                    "age_s": 0.4,
                    "priority": "standard",
                    "node": self.ids[-1],
                    "planned_peak": 0.97,
                    "ceiling": 0.92,
                    "kv_usage": 0.88,
                }
                if self.overload
                else None
            ),
        }
        return {
            "time": now,
            "policy": policy,
            "tenants": self._tenants(),
            "gateway": {
                "admissions": self._admissions(),
                "retry_after_count": int(self.retry_count),
                "retry_after_sum_s": self.retry_sum,
                "cancellations": {"streaming": int(self.cancellations)},
            },
            "scraper": {
                "interval_s": 0.05,
                "nodes": {
                    node: {
                        "last_latency_s": 0.002,
                        "consecutive_failures": 40 if node in self.stale else 0,
                        "last_error": "connect refused" if node in self.stale else None,
                        "page": "full" if node in self.full_page else "narrowed",
                        "page_note": (
                            "narrowed page lacks vllm:cache_config_info"
                            if node in self.full_page
                            else None
                        ),
                    }
                    for node in self.ids
                },
            },
        }

    def _tenants(self) -> dict[str, Any]:
        """The gateway's tenants table: two tenants, with the columns the gateway lists;
        team-a has a token budget (20,000 a minute), batch none."""
        rows = [
            {
                "tenant": name,
                "in_flight_requests": 7 * (i + 1),
                "in_flight_tokens": 12_345 * (i + 1),
                "queued": 3 * i,
                "refused": int(self.retry_count) * i,
                "served_tokens": int(self.admitted["standard"] * 900) + i,
                "budget_used": None if i else 4200,
                "budget_left": None if i else 15_800,
            }
            for i, name in enumerate(("team-a", "batch"))
        ]
        return {"columns": [list(column) for column in COLUMNS], "rows": rows}

    def _queue(self) -> dict[str, Any]:
        """The flow controller's queue section: an overload keeps requests waiting."""
        waiting = {"critical": 0, "standard": 40, "sheddable": 25} if self.overload else {}
        bands = {
            p: {
                "waiting": waiting.get(p, 0),
                "tokens": waiting.get(p, 0) * 1800,
                "oldest_s": 4.0 if waiting.get(p) else 0.0,
            }
            for p in PRIORITIES
        }
        return {
            "waiting": sum(b["waiting"] for b in bands.values()),
            "tokens": sum(b["tokens"] for b in bands.values()),
            "bands": bands,
            "tenants": {"": sum(b["waiting"] for b in bands.values())} if self.overload else {},
            "fairness": "tokens",
            "counters": {"queued": int(self.queued), "admitted_after_wait": int(self.queued)},
            "wait_total_s": self.queued * 1.5,
            "service": {},
        }

    def _admissions(self) -> dict[str, int]:
        """The gateway's flat `decision|priority|reason` counter keys."""
        out = {f"admit|{p}|ok": int(v) for p, v in self.admitted.items()}
        for p, reasons in self.rejected.items():
            out.update({f"reject|{p}|{r}": int(v) for r, v in reasons.items()})
        return out


def router(
    state_provider: Callable[[], dict[str, Any]],
    admin_token: str | None = None,
    max_stream_s: float = dashboard.MAX_STREAM_S,
    history: ChartHistory | None = None,
) -> Callable[..., Any]:
    """The dashboard's routes plus `/admin/state`, as the gateway would merge them.

    With `admin_token`, `/admin/state` wants `Authorization: Bearer <token>`; `history` is
    sent to each page as it connects.
    """
    closing = threading.Event()
    table = dashboard.routes(
        state_provider, closing=closing.is_set, max_stream_s=max_stream_s, history=history
    )
    expected = f"Bearer {admin_token}".encode() if admin_token else None

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        handler = table.get((scope["method"], scope["path"]))
        if handler is not None:
            await handler(scope, receive, send)
            return
        authorized = expected is None or (b"authorization", expected) in scope["headers"]
        if scope["path"] == "/admin/state" and not authorized:
            body, status = b'{"error": {"message": "admin token required"}}', 401
        elif scope["path"] == "/admin/state":
            body = orjson.dumps(state_provider())
            status = 200
        else:
            body, status = b'{"error": {"message": "not found"}}', 404
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    app.closing = closing  # type: ignore[attr-defined]  # set by serve() before stopping
    return app


@contextmanager
def serve(app: Callable[..., Any]) -> Iterator[str]:
    """Run `app` on uvicorn on an ephemeral 127.0.0.1 port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        closing = getattr(app, "closing", None)
        if closing is not None:
            closing.set()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
