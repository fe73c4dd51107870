"""The upstream side: the clients that talk to the engines, the backends, and their models.

Relayed requests go through `H1Pool` (kvgate.gateway.http.h1client), a keep-alive HTTP/1.1
pool on httptools that hands the relay the engine's bytes as they come: measured side by
side it costs 40-60 % of aiohttp's CPU per request and per streamed chunk
(`benchmarks/proxy_overhead/results.md`), and its socket callback is what lets a stream be
spliced. It speaks HTTP and HTTPS (certificates checked against the system's CAs). What is
off the hot path, model lists and abort calls, uses one shared `aiohttp.ClientSession`.
Neither opens a connection per request: that would cost more CPU than the whole relay.

Connection faults are sorted by whether the engine can have seen the request: a refused
or reset connection before any response byte is `UpstreamConnectError`, which the proxy may
retry once on another backend; anything later is final.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvgate.adapters.backend import Backend
from kvgate.gateway.http.h1client import H1Pool, H1Response
from kvgate.gateway.settings import UpstreamSettings

log = logging.getLogger(__name__)

#: How long a new upstream connection may take. An engine on the same network answers a
#: connect in well under a millisecond, and across regions in a few hundred; 2 s leaves
#: room for one lost SYN (retransmitted after 1 s) while a dead host still costs a request
#: only 2 s before its retry on another backend (and the scraper takes it out of rotation
#: within a second anyway).
CONNECT_TIMEOUT_S = 2.0
#: Connections of the side session (model lists, abort calls), not of the relay: a few per
#: backend at most, so this only bounds a runaway (e.g. a mass of aborts at once).
SIDE_SESSION_CONNECTIONS = 1000

#: Headers that describe one connection, not the message (RFC 9110 7.6.1), plus the ones
#: the client library computes itself. Lower-case bytes, as ASGI delivers them.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
        b"http2-settings",
    }
)


def _auth_of(backend: Backend) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in backend.auth_headers().items()]


class UpstreamPool:
    """The relay's connection pool, the side session, and the backends they talk to."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends: dict[str, Backend] = {b.node_id: b for b in backends}
        if len(self.backends) != len(backends):
            raise ValueError("two backends share one name; give them distinct `name`s")
        self._auth: dict[str, list[tuple[bytes, bytes]]] = {
            b.node_id: _auth_of(b) for b in backends
        }
        self._urls = collections.Counter(b.base_url for b in backends)  # base URL -> backends
        self._session: aiohttp.ClientSession | None = None
        self._h1: H1Pool | None = None

    def add(self, backend: Backend) -> None:
        """Relay to `backend` from now on (a backend added while running)."""
        self.backends[backend.node_id] = backend
        self._auth[backend.node_id] = _auth_of(backend)
        self._urls[backend.base_url] += 1

    def remove(self, node_id: str) -> None:
        """Stop relaying to `node_id`. Requests already on it go on to their end, then
        their connections close; idle ones close now (the side session's after its 30 s
        keep-alive)."""
        backend = self.backends.pop(node_id, None)
        self._auth.pop(node_id, None)
        if backend is None:
            return
        self._urls[backend.base_url] -= 1
        if self._urls[backend.base_url] <= 0:
            del self._urls[backend.base_url]
            if self._h1 is not None:
                self._h1.close_idle(backend.base_url)

    def _serves(self, base_url: str) -> bool:
        return base_url in self._urls

    @property
    def session(self) -> aiohttp.ClientSession:
        """The side session: model lists and abort calls, never a relayed request."""
        if self._session is None:
            raise RuntimeError("the upstream pool is not started")
        return self._session

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=SIDE_SESSION_CONNECTIONS,
            limit_per_host=0,
            keepalive_timeout=30.0,
            ttl_dns_cache=60,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Only new sockets get a connect timeout; each caller bounds its whole wait.
            timeout=aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=None
            ),
            # An abort's JSON body keeps its Content-Type; nothing asks for compression.
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._h1 = H1Pool(CONNECT_TIMEOUT_S, keep=self._serves)

    async def close(self) -> None:
        if self._h1 is not None:
            self._h1.close()
            self._h1 = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> H1Response:
        """Send the request and wait for the response headers (the caller bounds the wait).

        `headers` are the ASGI-style (lower-case bytes) headers to forward as they are.
        """
        if self._h1 is None:
            raise RuntimeError("the upstream pool is not started")
        auth = self._auth.get(backend.node_id)
        if auth:  # the engine's own key replaces whatever the client sent
            headers = [h for h in headers if h[0] != b"authorization"]
            headers.extend(auth)
        return await self._h1.request(backend.base_url, method, path_qs, headers, body)


#: How long the backends' model lists are reused. Models are loaded and unloaded on a scale
#: of minutes, and a model the catalog does not know yet is looked up at once anyway
#: (`ModelCatalog.resolve`), so a few seconds cost nothing and keep `/v1/models` cheap.
MODELS_TTL_S = 5.0


class ModelCatalog:
    """Which backend serves which model, from their `/v1/models`, refreshed lazily.

    The hot path only reads a dict. A stale catalog is used as is while one refresh runs in
    the background; an unknown model waits for a fresh look (at most four per second) before
    it is declared unknown, so a model loaded a moment ago is not refused.

    It also keeps each model's context limit, from the `max_model_len` vLLM (and SGLang)
    list for each model: `max_model_len(model)` is the largest among the backends serving
    it, or None as soon as one of them does not say.
    """

    def __init__(
        self, pool: UpstreamPool, ttl_s: float = MODELS_TTL_S, timeout_s: float = 2.0
    ) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._by_backend: dict[str, list[dict[str, Any]]] = {}
        self._nodes_by_model: dict[str, tuple[str, ...]] = {}
        self._context_limits: dict[str, int | None] = {}
        self._fetched_at = -1e9
        self._refresh: asyncio.Task[None] | None = None
        self._spawn: Callable[[Awaitable[None]], asyncio.Task[None]] | None = None

    def bind(self, spawn: Callable[[Awaitable[None]], asyncio.Task[None]]) -> None:
        """Background refreshes run in the owner's task group."""
        self._spawn = spawn

    @property
    def known(self) -> bool:
        return bool(self._by_backend)

    def forget(self, node_id: str) -> None:
        """Drop a removed backend's models at once (not at the next refresh), so that no
        new request is routed to it."""
        if self._by_backend.pop(node_id, None) is not None:
            self._index(self._by_backend)

    async def learn(self, backend: Backend) -> None:
        """Ask a backend added while running for its models (a refresh already under way
        may have started before it was added)."""
        entries = await self._fetch(backend)
        if entries is not None and self._pool.backends.get(backend.node_id) is backend:
            self._index({**self._by_backend, backend.node_id: entries})

    def nodes_for(self, model: str) -> tuple[str, ...] | None:
        """Backends serving `model`, or None when no backend lists it."""
        if time.monotonic() - self._fetched_at > self._ttl_s:
            self._refresh_in_background()
        return self._nodes_by_model.get(model)

    def max_model_len(self, model: str) -> int | None:
        """The longest context (prompt + output tokens) any backend serving `model` takes,
        or None when one of them does not list it."""
        return self._context_limits.get(model)

    async def resolve(self, model: str) -> tuple[str, ...] | None:
        """Like `nodes_for`, but looks again (rate-limited) before saying "unknown"."""
        nodes = self.nodes_for(model)
        if nodes is None and time.monotonic() - self._fetched_at > 0.25:
            await self.refresh()
            nodes = self._nodes_by_model.get(model)
        return nodes

    async def models(self) -> list[dict[str, Any]]:
        """The union of every backend's model objects, first backend wins on duplicates."""
        if time.monotonic() - self._fetched_at > self._ttl_s:
            await self.refresh()
        seen: dict[str, dict[str, Any]] = {}
        for entries in self._by_backend.values():
            for entry in entries:
                seen.setdefault(str(entry.get("id")), entry)
        return list(seen.values())

    def _refresh_in_background(self) -> None:
        if self._spawn is None or (self._refresh is not None and not self._refresh.done()):
            return
        self._refresh = self._spawn(self.refresh())

    async def refresh(self) -> None:
        """Ask every backend at once; one that fails keeps the models it listed last."""
        if self._refresh is not None and not self._refresh.done():
            current = asyncio.current_task()
            if self._refresh is not current:
                await asyncio.shield(self._refresh)
                return
        backends = list(self._pool.backends.values())
        results = await asyncio.gather(*(self._fetch(b) for b in backends))
        # A backend that fails to answer keeps the models it listed last: one slow answer
        # must not turn its models into 404s (a dead node is the policy's business).
        by_backend = dict(self._by_backend)
        for backend, result in zip(backends, results, strict=True):
            if result is not None:
                by_backend[backend.node_id] = result
        # Only backends still configured: one removed while this refresh ran stays out.
        configured = self._pool.backends
        self._index({k: v for k, v in by_backend.items() if k in configured})
        self._fetched_at = time.monotonic()

    def _index(self, by_backend: dict[str, list[dict[str, Any]]]) -> None:
        nodes: dict[str, list[str]] = {}
        limits: dict[str, int | None] = {}
        for node_id, entries in by_backend.items():
            for entry in entries:
                model = str(entry.get("id"))
                nodes.setdefault(model, []).append(node_id)
                limit = entry.get("max_model_len")
                if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                    limit = None
                known = limits.get(model, limit)
                limits[model] = None if known is None or limit is None else max(known, limit)
        self._by_backend = by_backend
        self._nodes_by_model = {k: tuple(v) for k, v in nodes.items()}
        self._context_limits = limits

    async def _fetch(self, backend: Backend) -> list[dict[str, Any]] | None:
        headers = dict(backend.auth_headers())
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._pool.session.get(
                    backend.base_url + "/v1/models", headers=headers
                ) as resp:
                    if resp.status != 200:
                        return None
                    data = orjson.loads(await resp.read())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, OSError) as exc:
            log.debug("models of %s unavailable: %r", backend.node_id, exc)
            return None
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            return None
        return [e for e in entries if isinstance(e, dict) and "id" in e]


@dataclass(frozen=True, slots=True)
class Upstream:
    """The relay's way to the engines: the connections, which engine serves which model,
    and how long an engine may keep a request waiting."""

    pool: UpstreamPool
    catalog: ModelCatalog
    settings: UpstreamSettings


def request_headers(
    raw: Iterable[tuple[bytes, bytes]], request_id: str, drop: frozenset[bytes] = frozenset()
) -> list[tuple[bytes, bytes]]:
    """The client's headers minus hop-by-hop ones, plus our `x-request-id`."""
    out = [
        (name, value)
        for name, value in raw
        if name not in HOP_BY_HOP and name != b"x-request-id" and name not in drop
    ]
    out.append((b"x-request-id", request_id.encode()))
    return out


def close_quietly(response: H1Response | None) -> None:
    """Close an upstream response at once: for vLLM the closed socket is the abort."""
    if response is None:
        return
    with contextlib.suppress(Exception):
        response.close()
