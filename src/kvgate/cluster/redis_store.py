"""The cluster store on Redis: one EVALSHA per sync tick (redis-py's asyncio client, hiredis).

Why this client: `benchmarks/store_client/results.md` (2.3x less CPU per sync-script call
than coredis). The key layout and the script are in `kvgate.cluster.lua`: a sorted set of
heartbeat deadlines on the store's clock and a hash of views, pruned, written and read by
one script, so a tick is one round trip and atomic. Both keys expire with the last beat.

URLs: `redis://[:password@]host:port/db`, `rediss://...` (TLS; `?ssl_ca_certs=/path` for
a private CA, `?ssl_cert_reqs=none` to skip verification) and `unix://[:password@]/path?db=N`.

redis-py retries nothing here (the sync task decides when to try again, within its own
timeout) and drops a connection whose command was cancelled, so a late reply can never be
read as the answer to the next command. The client has no socket (read/write) timeout of
its own: with one, redis-py sends through `asyncio.wait_for`, which on Python 3.11 loses a
cancellation that arrives as the send completes (measured: a cancelled sync task went on
beating in most of 300 tries), and a replica told to stop would not stop. Every call is
bounded by the caller's `asyncio.timeout` instead; connecting has its own timeout.

A server restarted empty has lost the script: the client's `Script` loads it again on
`NOSCRIPT`, and the tick after that finds the members gone and every replica beats itself
back in.
"""

from __future__ import annotations

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    InvalidResponse,
    RedisError,
    ResponseError,
    TimeoutError,
)

from kvgate.cluster import lua
from kvgate.cluster.store import Exchange, StoreError
from kvgate.cluster.urls import check_url, redact

#: Connect timeout of the client, TLS handshake included: inside the sync task's bound on
#: connecting (`PREPARE_TIMEOUT_S`, 1 s), so that a handshake nobody answers is named.
_CONNECT_TIMEOUT_S = 0.8


class RedisStore:
    def __init__(self, url: str, *, client_name: str = "kvgate") -> None:
        check_url(url)
        self._url = url
        self._client = aredis.Redis.from_url(
            url,
            socket_connect_timeout=_CONNECT_TIMEOUT_S,
            socket_timeout=None,  # see the note on cancellation above
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            client_name=client_name,
        )
        self._sync = self._client.register_script(lua.SYNC)
        self._leave = self._client.register_script(lua.LEAVE)
        self._keys = [lua.MEMBERS_KEY, lua.VIEWS_KEY]
        self._reached = False  # answered once: its failures are no longer the URL's

    async def exchange(self, member: str, view: bytes, ttl_s: float) -> Exchange:
        try:
            reply = await self._sync(keys=self._keys, args=[member, view, round(ttl_s * 1000)])
        except (RedisError, OSError) as exc:
            raise StoreError(self._problem(exc)) from exc
        self._reached = True
        try:
            seconds, micros, flat = reply
            views = {_text(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat), 2)}
            return Exchange(int(seconds) + int(micros) / 1e6, views)
        except (TypeError, ValueError, IndexError) as exc:
            raise StoreError(f"unreadable reply to the sync script: {exc}") from exc

    async def prepare(self) -> None:
        try:
            await self._client.script_load(lua.SYNC)  # connects first if need be
        except (RedisError, OSError) as exc:
            raise StoreError(self._problem(exc)) from exc

    async def leave(self, member: str) -> None:
        try:
            await self._leave(keys=self._keys, args=[member])
        except (RedisError, OSError) as exc:
            raise StoreError(self._problem(exc)) from exc

    async def close(self) -> None:
        await self._client.aclose()

    def describe(self) -> str:
        return redact(self._url)

    def _problem(self, exc: BaseException) -> str:
        return problem(exc, tls=self._url.startswith("rediss://"), first=not self._reached)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_error(exc: BaseException) -> str:
    """A store failure as its type and whole message (redis-py's carry no secrets)."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def problem(exc: BaseException, *, tls: bool, first: bool = True) -> str:
    """What a store failure means for an operator, then the client's own words: the
    problems a wrong `store.url` or a server that is not what it says give (`tls`: the URL
    asks for TLS). A handshake that times out or a connection closed at once hint at TLS
    only while the store has never answered (`first`): later, they are a server that
    went away."""
    text = str(exc)
    lower = text.lower()
    if isinstance(exc, AuthenticationError):
        if "hello must be called" in lower or "noauth" in lower or "required" in lower:
            what = "authentication failed: the server wants a password and the URL has none"
        else:
            what = "authentication failed: the server refused the URL's user or password"
    elif isinstance(exc, ResponseError) and "db index" in lower:
        what = "no such database: the server has fewer databases than the URL's number"
    elif isinstance(exc, InvalidResponse) or "protocol error" in lower:
        what = "not a Redis server: it answers in another protocol"
    elif "certificate" in lower:
        what = "TLS failed: the server's certificate is not trusted (?ssl_ca_certs=/path)"
    elif "wrong_version_number" in lower or "wrong version number" in lower:
        what = "TLS mismatch: the server does not speak TLS (redis://, not rediss://)"
    elif first and tls and isinstance(exc, TimeoutError) and "connecting" in lower:
        what = "TLS mismatch: the server never answered the TLS handshake (a plain redis://?)"
    elif first and not tls and ("reset by peer" in lower or "closed by server" in lower):
        what = "connection closed by the server at once (does it want TLS: rediss://?)"
    elif "error 111" in lower or "refused" in lower:
        what = "connection refused: nothing listens there"
    elif any(s in lower for s in _UNKNOWN_HOST):
        what = "unknown host: the name does not resolve"
    else:
        return describe_error(exc)
    return f"{what} ({describe_error(exc)})"


#: How a failed name lookup reads (glibc's, musl's and macOS's getaddrinfo messages).
_UNKNOWN_HOST = (
    "name or service not known",
    "nodename nor servname",
    "temporary failure in name resolution",
    "no address associated",
    "name does not resolve",
)
