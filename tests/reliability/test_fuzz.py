"""Property-based: whatever a client or a sidecar sends, kvgate answers a well-formed error
or accepts something sane; nothing raises past the parsers, nothing answers 500.

The ASGI tests drive the real `Gateway` in-process (no sockets, so hypothesis can run
hundreds of examples in a few seconds); its one backend refuses connections, so requests
that pass every check end as a 503 without an engine.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.adapters.push import PushValidationError, parse_push
from kvgate.config import load_config
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies.baselines import build_named
from kvgate.gateway.app import Gateway
from kvgate.gateway.http.errors import GatewayError
from kvgate.gateway.relay.intake import parse_completion
from kvgate.testing.books import ledger_totals

LIMIT = 4096
KEY = "fuzz-key-0123456789abcdef"
ADMIN = "fuzz-admin-0123456789"
_FAST = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()  # stdlib: integers beyond 64 bits too


json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=5,
)
request_objects = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values | st.sampled_from(["fake-model", "m"]),
        "prompt": json_values,
        "messages": json_values,
        "stream": json_values,
        "max_tokens": json_values | st.integers(min_value=-10, max_value=2 * LIMIT),
        "max_completion_tokens": json_values,
        "n": json_values,
    },
)
bodies = (
    st.binary(max_size=300)
    | request_objects.map(_json)
    | request_objects.map(lambda o: _json(o)[:-1])  # truncated JSON
    | st.builds(lambda b, i: b[:i] + b"\xff" + b[i:], request_objects.map(_json),
                st.integers(0, 40))  # invalid UTF-8 somewhere
)  # fmt: skip


@_FAST
@given(body=bodies)
def test_parse_completion_accepts_sane_requests_or_raises_a_400(body: bytes) -> None:
    try:
        parsed = parse_completion(body, LIMIT)
    except GatewayError as err:
        assert err.status == 400 and err.message and err.code
        return
    assert isinstance(parsed.model, str) and parsed.model
    assert isinstance(parsed.stream, bool)
    assert parsed.max_tokens is None or 0 <= parsed.max_tokens <= LIMIT


# ---- the whole ASGI app -------------------------------------------------------------------


async def _call(app: Gateway, method: str, path: str, headers: list, body: bytes) -> tuple:
    """One request through the ASGI app; returns (status, headers, body)."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    async with asyncio.timeout(10):
        await app(scope, receive, send)
    start = sent[0]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), payload


def _assert_openai_error(status: int, body: bytes) -> dict[str, Any]:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.fixture(scope="module")
def gateway_loop():
    """One gateway (with API keys) and one event loop for all examples of this module."""
    loop = asyncio.new_event_loop()
    config = load_config(
        None,
        **{
            "backends": [{"url": "http://127.0.0.1:9", "name": "refused"}],
            "limits.max_body_bytes": 4096,
            "auth.keys": [{"key": KEY, "tenant": "fuzz", "max_priority": "critical"}],
            "auth.tenants": {"fuzz": {"max_in_flight_tokens": 10 * LIMIT}},
            "server.admin_token": ADMIN,
        },
    )
    clock = MonotonicClock()
    gateway = Gateway(config, policy=build_named("none", config.admission, clock), clock=clock)
    running = gateway.running()
    loop.run_until_complete(running.__aenter__())
    try:
        yield gateway, loop
    finally:
        loop.run_until_complete(running.__aexit__(None, None, None))
        loop.close()


header_values = st.binary(max_size=40) | st.sampled_from(
    [b"critical", b"standard", b"sheddable", b"CRITICAL ", b"urgent", b""]
)


@_FAST
@given(
    body=bodies,
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]),
    auth=st.sampled_from([f"Bearer {KEY}".encode(), b"Bearer wrong", b"", b"Basic !!"]),
    priority=st.none() | header_values,
    request_id=st.none() | st.binary(max_size=200),
)
def test_the_app_never_answers_500(gateway_loop, body, path, auth, priority, request_id) -> None:
    gateway, loop = gateway_loop
    headers = [(b"content-type", b"application/json")]
    if auth:
        headers.append((b"authorization", auth))
    if priority is not None:
        headers.append((b"x-kvgate-priority", priority))
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    status, _, payload = loop.run_until_complete(_call(gateway, "POST", path, headers, body))
    assert status in (400, 401, 404, 413, 429, 503), (status, payload)
    _assert_openai_error(status, payload)
    if auth != f"Bearer {KEY}".encode():
        assert status == 401
    # Nothing is held after the answer, whatever the path.
    assert gateway.metrics.in_flight == 0
    snap = gateway.admission.snapshot()
    assert snap["in_flight_requests"] == 0 and snap["queue"]["waiting"] == 0
    assert ledger_totals(gateway.security.ledger)[0] == 0


# ---- pushed engine samples ----------------------------------------------------------------

numbers = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.sampled_from([7.3, -0.1, 1.0000001, float("nan"), 0.5])
)
samples = st.fixed_dictionaries(
    {"node": st.sampled_from(["refused", "a:1", "", " x", "n" * 300]) | json_values},
    optional={
        "kv_usage": numbers | json_values, "KVCacheUsage": numbers,
        "kv_capacity_tokens": numbers, "running": numbers | json_values,
        "waiting": numbers, "iteration_latency_s": numbers, "IterationLatencyMs": numbers,
        "preemptions_total": numbers, "surprise": json_values,
    },
)  # fmt: skip


def _dump(obj: Any) -> bytes:
    """JSON with NaN/Infinity written as literals, the way a sloppy sidecar would."""
    return json.dumps(obj).encode()


@_FAST
@given(body=samples | st.lists(samples, max_size=3))
def test_pushed_samples_are_sane_or_refused(body: Any) -> None:
    raw = _dump(body)
    try:
        accepted = parse_push(raw, now=1.0)
    except PushValidationError as err:
        assert str(err)
        return
    for node, sample in accepted:
        assert isinstance(node, str) and node and len(node) <= 256
        assert sample.kv_usage is None or 0.0 <= sample.kv_usage <= 1.0
        assert sample.running >= 0 and sample.waiting >= 0
        for value in (sample.iteration_latency_s, sample.preemptions_total):
            assert value is None or (math.isfinite(value) and value >= 0)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"node": "refused", "kv_usage": 7.3}',
        b'{"node": "refused", "kv_usage": NaN}',
        b'{"node": "refused", "kv_usage": -0.5}',
        b'{"node": "refused", "kv_usage": 0.5, "running": -1}',
        b'{"node": "unknown-node", "kv_usage": 0.5}',
    ],
)
def test_bad_pushes_are_400_through_the_app(gateway_loop, raw: bytes) -> None:
    gateway, loop = gateway_loop
    headers = [(b"authorization", f"Bearer {ADMIN}".encode())]
    status, _, payload = loop.run_until_complete(
        _call(gateway, "POST", "/admin/signals", headers, raw)
    )
    assert status == 400, payload
    _assert_openai_error(status, payload)


def test_good_push_needs_the_admin_token(gateway_loop) -> None:
    gateway, loop = gateway_loop
    raw = b'{"node": "refused", "kv_usage": 0.25, "running": 1}'
    denied = loop.run_until_complete(
        _call(gateway, "POST", "/admin/signals", [(b"authorization", b"Bearer x")], raw)
    )
    assert denied[0] == 401
    ok = loop.run_until_complete(
        _call(
            gateway, "POST", "/admin/signals", [(b"authorization", f"Bearer {ADMIN}".encode())], raw
        )
    )
    assert ok[0] == 202
