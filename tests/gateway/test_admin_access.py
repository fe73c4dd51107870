"""One admin rule: every admin route and the dashboard accept and refuse the same credentials.

The rule (kvgate.gateway.security.admin): with `server.admin_token` set, every route under
`/admin/` and `/dashboard` wants that token, as a bearer token or as HTTP Basic auth's
password (any user name), keys or no keys: anything else is 401 `invalid_admin_token`.
Without it, the controls (reload, signals) are closed with their own 403, and the views
are open exactly when no API keys are configured (403 `admin_disabled` otherwise).

Each case runs every admin route of the gateway's own route table (so a route added later
is covered too) plus an unknown admin path, in-process through the ASGI app, front door
included.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
import pytest

from kvgate.config import load_config
from kvgate.gateway.app import Gateway
from kvgate.gateway.security.admin import is_admin_path

TOKEN = "admin-token-0123456789"
KEY = "client-key-0123456789abcdef"
CONTROL_CODES = {"/admin/reload": "reload_disabled", "/admin/signals": "push_disabled"}


def _basic(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


#: Credentials the token's holder may send: each is accepted wherever a token is set.
ADMIN = {
    "bearer": f"Bearer {TOKEN}".encode(),
    "bearer, lower-case scheme": f"bearer {TOKEN}".encode(),
    "basic, any user": _basic("ops", TOKEN),
    "basic, no user": _basic("", TOKEN),
}
#: Everything else: each is refused wherever a token is set.
OTHERS = {
    "nothing": None,
    "wrong bearer": b"Bearer not-the-token",
    "the client key": f"Bearer {KEY}".encode(),
    "token as the basic user": _basic(TOKEN, ""),
    "malformed basic": b"Basic !!",
    "bare token": TOKEN.encode(),
}


def _gateway(token: bool, keys: bool) -> Gateway:
    settings: dict[str, Any] = {"backends": [{"url": "http://127.0.0.1:9", "name": "n0"}]}
    if token:
        settings["server.admin_token"] = TOKEN
    if keys:
        settings["auth.keys"] = [{"key": KEY, "tenant": "t"}]
    return Gateway(load_config(None, **settings))


def _admin_routes(gateway: Gateway) -> list[tuple[str, str]]:
    routes = [key for key in gateway.routes if is_admin_path(key[1])]
    assert {("GET", "/admin/state"), ("GET", "/admin/events"), ("GET", "/dashboard")} <= set(routes)
    assert {("POST", "/admin/reload"), ("POST", "/admin/signals")} <= set(routes)
    return [*routes, ("GET", "/admin/no-such-route")]


async def _answer(
    gateway: Gateway, method: str, path: str, credential: bytes | None
) -> tuple[int, dict[bytes, bytes], bytes]:
    """The status, headers and first body bytes of one request (an event stream is
    cancelled after its first frame)."""
    headers = [] if credential is None else [(b"authorization", credential)]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": headers, "http_version": "1.1",
             "scheme": "http", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    loop = asyncio.get_running_loop()
    start: asyncio.Future[dict[str, Any]] = loop.create_future()
    body: asyncio.Future[bytes] = loop.create_future()
    request = [{"type": "http.request", "body": b"[]", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await loop.create_future()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not start.done():
            start.set_result(message)
        elif message["type"] == "http.response.body" and not body.done():
            body.set_result(message.get("body", b""))

    task = asyncio.create_task(gateway(scope, receive, send))
    try:
        async with asyncio.timeout(10):
            started, first = await start, await body
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return started["status"], dict(started["headers"]), first


def _refusal(status: int, body: bytes) -> tuple[int, str]:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return status, error["code"]


@pytest.mark.parametrize("keys", [False, True], ids=["no keys", "keys"])
async def test_with_an_admin_token_every_admin_route_wants_it(keys: bool) -> None:
    gateway = _gateway(token=True, keys=keys)
    for method, path in _admin_routes(gateway):
        for name, credential in ADMIN.items():
            status, _, _ = await _answer(gateway, method, path, credential)
            assert status not in (401, 403), (method, path, name, status)
        for name, credential in OTHERS.items():
            status, headers, body = await _answer(gateway, method, path, credential)
            assert _refusal(status, body) == (401, "invalid_admin_token"), (method, path, name)
            assert headers[b"www-authenticate"].startswith(b"Basic "), (method, path, name)


async def test_with_keys_and_no_admin_token_every_admin_route_is_closed() -> None:
    gateway = _gateway(token=False, keys=True)
    for method, path in _admin_routes(gateway):
        code = CONTROL_CODES.get(path, "admin_disabled")
        for name, credential in {**ADMIN, **OTHERS}.items():
            status, _, body = await _answer(gateway, method, path, credential)
            assert _refusal(status, body) == (403, code), (method, path, name)


async def test_without_keys_or_admin_token_views_are_open_and_controls_closed() -> None:
    gateway = _gateway(token=False, keys=False)
    for method, path in _admin_routes(gateway):
        for name, credential in {**ADMIN, **OTHERS}.items():
            status, _, body = await _answer(gateway, method, path, credential)
            if path in CONTROL_CODES:
                assert _refusal(status, body) == (403, CONTROL_CODES[path]), (path, name)
            else:
                assert status not in (401, 403), (method, path, name, status)


async def test_an_admitted_admin_reaches_each_route() -> None:
    """Past the check, each route does its own work (its own answers, not the check's)."""
    gateway = _gateway(token=True, keys=True)
    credential = ADMIN["basic, any user"]
    state = await _answer(gateway, "GET", "/admin/state", credential)
    assert state[0] == 200 and "policy" in orjson.loads(state[2])
    events = await _answer(gateway, "GET", "/admin/events", credential)
    assert events[0] == 200 and events[2].startswith(b"retry: ")  # the stream opened
    assert (await _answer(gateway, "GET", "/dashboard", credential))[0] == 200
    reload = await _answer(gateway, "POST", "/admin/reload", credential)
    assert _refusal(reload[0], reload[2]) == (409, "reload_unavailable")  # built in code
    signals = await _answer(gateway, "POST", "/admin/signals", credential)
    assert signals[0] in (202, 400)  # an empty list of samples, judged by the route
    unknown = await _answer(gateway, "GET", "/admin/no-such-route", credential)
    assert _refusal(unknown[0], unknown[2]) == (404, "not_found")
