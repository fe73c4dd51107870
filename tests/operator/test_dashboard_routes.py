"""The dashboard's routes served by a real uvicorn: page, static files, the SSE stream."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from opview_synthetic import SyntheticCluster, router, serve

from kvgate.gateway.ops import dashboard


def _events(response: httpx.Response, wanted: int, timeout_s: float = 5.0) -> list[str]:
    """Read `wanted` SSE frames (event type + data) from a streaming response."""
    frames: list[str] = []
    deadline = time.monotonic() + timeout_s
    buffer = ""
    for chunk in response.iter_text():
        buffer += chunk
        while "\n\n" in buffer:
            frame, buffer = buffer.split("\n\n", 1)
            if "data:" in frame:
                frames.append(frame)
        if len(frames) >= wanted or time.monotonic() > deadline:
            break
    return frames


def test_routes_cover_page_static_files_and_events() -> None:
    table = dashboard.routes(lambda: {})
    paths = {path for method, path in table if method == "GET"}
    assert {"/dashboard", "/admin/events"} <= paths
    for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert f"/dashboard/static/{name}" in paths
    assert "/dashboard/static/uPlot.LICENSE.txt" in paths  # the vendored library's license


def test_page_loads_only_its_own_files() -> None:
    """Nothing from a CDN: every script/stylesheet the page names is served by us."""
    cluster = SyntheticCluster(2)
    with serve(router(cluster.state)) as url, httpx.Client(base_url=url) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert refs, "the page references its scripts and styles"
        for ref in refs:
            if ref.startswith("data:"):
                continue
            assert ref.startswith("/dashboard/static/"), ref
            asset = client.get(ref)
            assert asset.status_code == 200, ref
            assert int(asset.headers["content-length"]) == len(asset.content) > 0
        script = client.get("/dashboard/static/dashboard.js")
        assert "http://" not in script.text and "https://" not in script.text
        # Revalidation is cheap: the same ETag gets a 304 without a body.
        etag = script.headers["etag"]
        again = client.get("/dashboard/static/dashboard.js", headers={"If-None-Match": etag})
        assert again.status_code == 304 and again.content == b""
        assert script.headers["cache-control"] == "no-cache"


def test_events_stream_pushes_state_about_five_times_a_second() -> None:
    cluster = SyntheticCluster(3)
    with (
        serve(router(cluster.state)) as url,
        httpx.Client(base_url=url, timeout=5) as client,
        client.stream("GET", "/admin/events") as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        started = time.monotonic()
        frames = _events(response, wanted=6)
        elapsed = time.monotonic() - started
    assert len(frames) == 6
    states = [orjson.loads(frame.split("data: ", 1)[1]) for frame in frames]
    assert all(set(s["policy"]["nodes"]) == {"node-00", "node-01", "node-02"} for s in states)
    assert [s["time"] for s in states] == sorted(s["time"] for s in states)
    # Six frames at 5 Hz need about a second (the first is immediate); generous upper bound.
    assert 0.7 < elapsed < 4.0


def test_events_stop_promptly_when_the_client_disconnects() -> None:
    calls = {"n": 0}
    lock = threading.Lock()

    def provider() -> dict[str, Any]:
        with lock:
            calls["n"] += 1
        return {"time": time.monotonic(), "nodes": {}}

    with serve(router(provider)) as url:
        with (
            httpx.Client(base_url=url, timeout=5) as client,
            client.stream("GET", "/admin/events?interval_ms=100") as response,
        ):
            assert len(_events(response, wanted=3)) == 3
        time.sleep(0.5)  # the disconnect reaches the server; its loop must notice
        after_close = calls["n"]
        time.sleep(0.6)  # six periods at 100 ms: a loop still running would call 6 more times
        assert calls["n"] == after_close


def _stream_length(app: Any, during: Callable[[], None] | None = None) -> float:
    """Seconds until the server itself ends an event stream (bounded by the client timeout)."""
    with (
        serve(app) as url,
        httpx.Client(base_url=url, timeout=10) as client,
        client.stream("GET", "/admin/events?interval_ms=100") as response,
    ):
        started = time.monotonic()
        chunks = response.iter_bytes()
        next(chunks)
        if during is not None:
            during()
        for _ in chunks:
            if time.monotonic() - started > 8:
                break
        return time.monotonic() - started


def test_streams_end_when_the_gateway_is_closing() -> None:
    """An open dashboard must not hold up a gateway's graceful shutdown."""
    app = router(SyntheticCluster(1).state)
    elapsed = _stream_length(app, during=app.closing.set)
    assert elapsed < 2.0


def test_streams_are_bounded_in_time_and_say_how_soon_to_reconnect() -> None:
    app = router(SyntheticCluster(1).state, max_stream_s=0.6)
    elapsed = _stream_length(app)
    assert 0.5 < elapsed < 3.0
    app = router(SyntheticCluster(1).state, max_stream_s=0.6)  # the last one was closed
    with serve(app) as url, httpx.Client(base_url=url, timeout=5) as client:
        body = client.get("/admin/events").text  # ends by itself after 0.6 s
    assert body.startswith(f"retry: {dashboard.RECONNECT_MS}\n\n")
    assert body.count("data: ") >= 2


def test_a_failing_state_provider_yields_error_events_not_a_dead_stream() -> None:
    calls = {"n": 0}

    def provider() -> dict[str, Any]:
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("policy exploded")
        return {"time": 1.0, "nodes": {}}

    with (
        serve(router(provider)) as url,
        httpx.Client(base_url=url, timeout=5) as client,
        client.stream("GET", "/admin/events?interval_ms=100") as response,
    ):
        frames = _events(response, wanted=4)
    kinds = ["error" if frame.startswith("event: error") else "state" for frame in frames]
    assert "error" in kinds and "state" in kinds
    error = next(f for f in frames if f.startswith("event: error"))
    assert "RuntimeError" in orjson.loads(error.split("data: ", 1)[1])["message"]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (b"", 0.2),
        (b"interval_ms=500", 0.5),
        (b"interval_ms=1", 0.1),  # clamped: a client cannot make the server spin
        (b"interval_ms=999999", 5.0),
        (b"interval_ms=nan", 0.2),
        (b"interval_ms=abc", 0.2),
    ],
)
def test_interval_is_clamped(query: bytes, expected: float) -> None:
    assert dashboard.parse_interval(query) == pytest.approx(expected)


def test_event_frames_are_single_line_json() -> None:
    frame = dashboard.encode_event({"text": "a\nb", 3: float("inf")})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 2
    assert orjson.loads(frame[6:]) == {"text": "a\nb", "3": None}


def test_the_gateway_serves_the_dashboard_and_streams_its_own_state() -> None:
    """The real Gateway merges these routes; its stream carries its nested state."""
    from kvgate.config import KvgateConfig
    from kvgate.gateway.app import Gateway

    config = KvgateConfig(backends=[{"url": "http://127.0.0.1:9", "name": "n0"}])
    with serve(Gateway(config)) as url, httpx.Client(base_url=url, timeout=5) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert client.get("/dashboard/static/uPlot.iife.min.js").status_code == 200
        with client.stream("GET", "/admin/events") as response:
            frames = _events(response, wanted=2)
    state = orjson.loads(frames[-1].split("data: ", 1)[1])
    assert state["policy"]["policy"] == "adaptive"
    assert "n0" in state["policy"]["nodes"]


def test_open_dashboards_share_one_snapshot() -> None:
    """Several clients within the cache's lifetime cost one call of the state provider."""
    calls = {"n": 0}

    def provider() -> dict[str, Any]:
        calls["n"] += 1
        return {"time": calls["n"]}

    async def scenario() -> tuple[list[bytes], int]:
        cache = dashboard.FrameCache(provider, ttl_s=10.0)
        frames = [cache.get() for _ in range(5)]
        return frames, cache.builds

    frames, builds = asyncio.run(scenario())
    assert builds == 1 and calls["n"] == 1
    assert len(set(frames)) == 1


def _frames(response: httpx.Response, wanted: int) -> list[str]:
    """The first `wanted` SSE events of a stream, whatever their type."""
    frames: list[str] = []
    buffer = ""
    for chunk in response.iter_text():
        buffer += chunk
        while "\n\n" in buffer and len(frames) < wanted:
            frame, buffer = buffer.split("\n\n", 1)
            if "data:" in frame:
                frames.append(frame)
        if len(frames) >= wanted:
            break
    return frames


def test_a_gateway_sends_its_history_first_then_states_with_their_time_as_id() -> None:
    """Every page gets the gateway's last minutes of chart points as it connects; one that
    reconnects (EventSource repeats the last id it saw) gets only the points after it."""
    from kvgate.config import KvgateConfig
    from kvgate.gateway.app import Gateway
    from kvgate.testing.polling import POLL_INTERVAL_S

    gateway = Gateway(KvgateConfig(backends=[{"url": "http://127.0.0.1:9", "name": "e"}]))
    gateway.history.every_s = 0.05  # a point every 50 ms instead of every second
    with serve(gateway) as url, httpx.Client(base_url=url, timeout=5) as client:
        deadline = time.monotonic() + 10
        while len(gateway.history) < 8 and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        with client.stream("GET", "/admin/events") as response:
            first, live = _frames(response, 2)
        assert first.startswith("event: history\ndata: ")
        history = orjson.loads(first.split("data: ", 1)[1])
        live_id = float(live.split("id: ", 1)[1].split("\n", 1)[0])
        state = orjson.loads(live.split("data: ", 1)[1])
        time.sleep(0.3)  # a few more points
        headers = {"Last-Event-ID": repr(live_id)}
        with client.stream("GET", "/admin/events", headers=headers) as response:
            again = orjson.loads(_frames(response, 1)[0].split("data: ", 1)[1])
    points = history["points"]
    assert len(points) >= 8
    times = [p["time"] for p in points]
    assert times == sorted(times) and times[-1] <= history["now"] == live_id == state["time"]
    newest = points[-1]
    assert set(newest) == {"time", "policy", "gateway"}
    assert set(newest["policy"]["nodes"]) == {"e"}
    assert "admissions" in newest["gateway"] and "bands" in newest["policy"]["queue"]
    assert again["points"] and all(p["time"] > live_id for p in again["points"])
    assert len(again["points"]) < len(points)
