"""The operator's live view: `GET /dashboard`, its static files, and `GET /admin/events`.

The page is plain HTML + JS with a vendored chart library (uPlot, MIT) so it runs with no
build step and nothing fetched from a CDN: an on-call operator may be inside a network that
reaches only the gateway. The page is fed by server-sent events carrying the same JSON as
`/admin/state`, a few times per second, each with the state's time as its id; rates are
derived in the browser from counters. The gateway keeps one history for every page
(`history.ChartHistory`: the last minutes of what the charts draw), sent as a `history`
event when a page connects, so that a tab opened now charts what came before it.

The gateway merges `routes(state_provider)` into its own routing table; every value is a raw
ASGI callable, so this module depends on nothing but the standard library and orjson.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import orjson

from kvgate.gateway.http.asgi import ASGIApp, Receive, Scope, Send
from kvgate.gateway.ops.history import ChartHistory, last_event_id

StateProvider = Callable[[], dict[str, Any]]

log = logging.getLogger(__name__)

STATIC_PREFIX = "/dashboard/static/"
EVENTS_PATH = "/admin/events"
DEFAULT_INTERVAL_S = 0.2  # 5 updates per second: smooth enough, cheap with 64 nodes
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 5.0
# Below the gateway's default drain (30 s): even a gateway that cannot tell us it is
# stopping is not kept waiting by a dashboard tab for longer than its drain.
MAX_STREAM_S = 25.0
RECONNECT_MS = 250

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}

# The page may talk only to its own origin: no CDN, no inline script from elsewhere.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"
)


def routes(
    state_provider: StateProvider,
    closing: Callable[[], bool] | None = None,
    max_stream_s: float = MAX_STREAM_S,
    history: ChartHistory | None = None,
) -> dict[tuple[str, str], ASGIApp]:
    """Every route the dashboard needs, keyed by (method, exact path), for the gateway.

    `closing()` turning true (the gateway is draining) ends every event stream within one
    period, so an open dashboard tab never holds up a shutdown. Without it, `max_stream_s`
    bounds how long one stream lives (the browser reconnects on its own in a blink).
    `history`, when given, is sent to each page as it connects.
    """
    table: dict[tuple[str, str], ASGIApp] = {
        ("GET", "/dashboard"): _static_app("dashboard.html"),
        ("GET", "/dashboard/"): _static_app("dashboard.html"),
        ("GET", EVENTS_PATH): events_app(state_provider, closing, max_stream_s, history),
    }
    for name in static_files():
        if name == "dashboard.html":
            continue
        table[("GET", STATIC_PREFIX + name)] = _static_app(name)
    return table


def static_files() -> list[str]:
    """Names of the files shipped under `kvgate/gateway/ops/static/` (package data)."""
    folder = resources.files("kvgate.gateway.ops").joinpath("static")
    return sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_file() and _content_type(entry.name) is not None
    )


def _content_type(name: str) -> str | None:
    dot = name.rfind(".")
    return _CONTENT_TYPES.get(name[dot:]) if dot >= 0 else None


def _static_app(name: str) -> ASGIApp:
    """Serve one packaged file, read once (files never change while kvgate runs).

    `no-cache` + an ETag: the browser revalidates every load (a 304 without body), so a
    kvgate upgrade never leaves a tab running last release's script against this one's page.
    """
    content_type = _content_type(name) or "application/octet-stream"
    loaded: list[tuple[bytes, bytes]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if not loaded:
            folder = resources.files("kvgate.gateway.ops").joinpath("static")
            data = folder.joinpath(name).read_bytes()
            loaded.append((data, b'"' + hashlib.sha256(data).hexdigest()[:32].encode() + b'"'))
        body, etag = loaded[0]
        headers = [
            (b"etag", etag),
            (b"cache-control", b"no-cache"),
            (b"x-content-type-options", b"nosniff"),
        ]
        if _matches(scope, etag):
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        headers += [
            (b"content-type", content_type.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        if name.endswith(".html"):
            headers.append((b"content-security-policy", _CSP.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _matches(scope: Scope, etag: bytes) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"if-none-match":
            return etag in [tag.strip() for tag in value.split(b",")] or value.strip() == b"*"
    return False


def parse_interval(query_string: bytes) -> float:
    """`?interval_ms=200` picks the push period, clamped so a client can't make us spin."""
    values = parse_qs(query_string.decode("latin-1")).get("interval_ms")
    if not values:
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(values[0]) / 1000.0
    except ValueError:
        return DEFAULT_INTERVAL_S
    if not math.isfinite(seconds):
        return DEFAULT_INTERVAL_S
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, seconds))


def encode_event(state: Any) -> bytes:
    """One SSE `data:` frame. orjson never emits raw newlines, so one line is always enough.

    Non-string keys are allowed only on a retry: the option doubles the encoding cost and
    the states the gateway produces have string keys.
    """
    try:
        payload = orjson.dumps(state, default=str)
    except TypeError:
        payload = orjson.dumps(state, default=str, option=orjson.OPT_NON_STR_KEYS)
    return b"data: " + payload + b"\n\n"


def _snapshot_frame(state_provider: StateProvider) -> tuple[bytes, float | None]:
    """The next frame and its state's time (its SSE id); a failing provider becomes an
    `error` event, never a dead stream."""
    try:
        state = state_provider()
        frame = encode_event(state)
    except Exception as exc:  # the dashboard must survive a bug elsewhere
        log.exception("state provider failed while feeding /admin/events")
        message = orjson.dumps({"message": f"state unavailable: {type(exc).__name__}"})
        return b"event: error\ndata: " + message + b"\n\n", None
    at = state.get("time") if isinstance(state, dict) else None
    if not isinstance(at, int | float) or not math.isfinite(at):
        return frame, None
    return b"id: " + repr(float(at)).encode() + b"\n" + frame, float(at)


def events_app(
    state_provider: StateProvider,
    closing: Callable[[], bool] | None = None,
    max_stream_s: float = MAX_STREAM_S,
    history: ChartHistory | None = None,
) -> ASGIApp:
    """`GET /admin/events`: push `state_provider()` as SSE until the client goes away,
    after `history`'s points (those after the `Last-Event-ID` of a page that reconnects).

    A background task waits on `receive()` for `http.disconnect`, so a closed tab stops the
    loop within one period instead of at the next failed write. The stream also ends when
    `closing()` says the server is stopping, or after `max_stream_s`; EventSource then
    reconnects by itself after `retry` milliseconds.
    """
    stop = _Stop(closing, max_stream_s)
    frames = FrameCache(state_provider)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        interval = parse_interval(scope.get("query_string", b""))
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache, no-transform"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            retry = f"retry: {RECONNECT_MS}\n\n".encode()
            await send({"type": "http.response.body", "body": retry, "more_body": True})
            frames.get()
            if history is not None and frames.time is not None:
                seen = last_event_id(scope.get("headers", ()))
                past = history.event(frames.time, after=seen)
                await send({"type": "http.response.body", "body": past, "more_body": True})
            await _push_loop(frames, send, gone, interval, stop)
        except OSError:
            pass  # the client vanished mid-write; nothing to tell anyone
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if not gone.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


class _Stop:
    """When a stream should end on the server's initiative."""

    def __init__(self, closing: Callable[[], bool] | None, max_stream_s: float) -> None:
        self.closing = closing
        self.max_stream_s = max_stream_s

    def now(self, started: float) -> bool:
        if asyncio.get_running_loop().time() - started >= self.max_stream_s:
            return True
        if self.closing is None:
            return False
        try:
            return bool(self.closing())
        except Exception:  # a broken hook must not kill the stream loop with an error
            log.exception("dashboard closing() hook failed")
            return False


class FrameCache:
    """One snapshot and one encoding shared by every open dashboard within `ttl_s`.

    Ten operators watching during an incident then cost the gateway what one does.
    """

    def __init__(self, state_provider: StateProvider, ttl_s: float = 0.05) -> None:
        self.state_provider = state_provider
        self.ttl_s = ttl_s
        self.built_at = -math.inf
        self.frame = b""
        self.time: float | None = None  # the frame's state's time
        self.builds = 0

    def get(self) -> bytes:
        now = asyncio.get_running_loop().time()
        if now - self.built_at >= self.ttl_s:
            self.frame, self.time = _snapshot_frame(self.state_provider)
            self.built_at = now
            self.builds += 1
        return self.frame


async def _push_loop(
    frames: FrameCache, send: Send, gone: asyncio.Event, interval: float, stop: _Stop
) -> None:
    started = asyncio.get_running_loop().time()
    while not gone.is_set() and not stop.now(started):
        frame = frames.get()
        await send({"type": "http.response.body", "body": frame, "more_body": True})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), timeout=interval)


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Drain the request side; any `http.disconnect` (or a dead receive) ends the stream."""
    try:
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                break
    except Exception:  # a server that cannot receive any more has lost the client too
        log.debug("receive() failed under /admin/events", exc_info=True)
    gone.set()  # not on cancellation: then the stream ends on our side and is closed cleanly
