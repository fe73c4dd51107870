"""The scraper's HTTP client: a lean HTTP/1.1 GET for metrics pages.

Why not aiohttp: a GET through `aiohttp.ClientSession` costs about twice the CPU of this
one (180 against 328 µs per scrape, parse included, measured side by side in
`benchmarks/scrape_cost/results.md`); at 20 scrapes per second per node that is what limits
how many nodes one process can watch. The lean fetcher reuses the relay's keep-alive
HTTP/1.1 pool (httptools parses, as in uvicorn). It only does what a metrics scrape needs:
GET, keep-alive, HTTP or HTTPS, no redirects, no proxies, no compression (it asks for
`identity`, which every Prometheus client honours). Anything else is a hard failure.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urlsplit

from kvgate.adapters.base import MAX_PAGE_BYTES
from kvgate.gateway.http.errors import UpstreamError
from kvgate.gateway.http.h1client import H1Pool, H1Response


class ScrapeError(Exception):
    """A scrape that produced no page: HTTP status, oversized or malformed response."""


class MetricsFetcher(Protocol):
    """What the scraper needs from HTTP: the body of a 200 answer to a GET, or an error."""

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes: ...

    def forget(self, url: str) -> None:
        """`url` will not be asked again (its node was removed): drop what is kept for it."""

    async def close(self) -> None: ...


class LeanHttpFetcher:
    """Metrics GETs over the relay's own keep-alive pool (`h1client.H1Pool`, httptools).

    One HTTP/1.1 client serves the relay and the scraper: the parsing is httptools', the
    pooling is the relay's, and a failed or timed-out GET drops its connection. The
    caller bounds each `get` with its own timeout (cancellation closes the connection).
    """

    def __init__(
        self, ssl_context: ssl.SSLContext | None = None, connect_timeout_s: float = 2.0
    ) -> None:
        self._pool = H1Pool(connect_timeout_s, ssl_context)
        self._targets: dict[str, tuple[str, str]] = {}

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes:
        base, target = self._targets.get(url) or self._split(url)
        fields = [*_FIXED_HEADERS, *((k.encode(), v.encode()) for k, v in headers.items())]
        try:
            response = await self._pool.request(base, "GET", target, fields, b"")
        except UpstreamError as exc:
            raise ScrapeError(str(exc)) from None
        try:
            body = await self._read_body(response)
        except BaseException:
            response.close()
            raise
        response.release()
        return body

    def forget(self, url: str) -> None:
        """Close the idle keep-alive connections to `url`'s server (if it was asked)."""
        target = self._targets.pop(url, None)
        if target is not None:
            self._pool.close_idle(target[0])

    def _split(self, url: str) -> tuple[str, str]:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ScrapeError(f"unsupported metrics URL {url!r}")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._targets[url] = split = (f"{parts.scheme}://{parts.netloc}", target)
        return split

    @staticmethod
    async def _read_body(response: H1Response) -> bytes:
        if response.status != 200:
            raise ScrapeError(f"HTTP {response.status}")
        for name, value in response.raw_headers:
            lowered = name.lower()
            if lowered == b"content-encoding" and value.lower() not in (b"", b"identity"):
                raise ScrapeError(f"unexpected content-encoding {value[:20]!r}")
            if lowered == b"content-length" and int(value or b"0") > MAX_PAGE_BYTES:
                raise ScrapeError(f"page of {value.decode('latin-1')} bytes is too large")
        if not response.delimited:
            raise ScrapeError("response has neither Content-Length nor chunked encoding")
        parts: list[bytes] = []
        size = 0
        try:
            while chunk := await response.readany():
                size += len(chunk)
                if size > MAX_PAGE_BYTES:
                    raise ScrapeError(f"page larger than {MAX_PAGE_BYTES} bytes")
                parts.append(chunk)
        except UpstreamError as exc:
            raise ScrapeError(str(exc)) from None
        return b"".join(parts)

    async def close(self) -> None:
        self._pool.close()


_FIXED_HEADERS = (
    (b"user-agent", b"kvgate-scraper"),
    (b"accept", b"text/plain;version=0.0.4, */*;q=0.1"),
    (b"accept-encoding", b"identity"),
)
