"""The scraper's fetcher contract through aiohttp: the baseline the lean client was chosen
against (`bench_scrape.py`, `bench_real_vllm.py`). kvgate itself scrapes with
`kvgate.gateway.engines.scrape_http.LeanHttpFetcher` only."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from kvgate.adapters.base import MAX_PAGE_BYTES
from kvgate.gateway.engines.scrape_http import ScrapeError


class AiohttpFetcher:
    """GETs through the caller's `aiohttp.ClientSession` (the caller closes it)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def get(self, url: str, headers: Mapping[str, str]) -> bytes:
        async with self._session.get(url, headers=dict(headers), allow_redirects=False) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            body = await resp.content.read(MAX_PAGE_BYTES + 1)
            if len(body) > MAX_PAGE_BYTES:
                raise ScrapeError(f"page larger than {MAX_PAGE_BYTES} bytes")
            return body

    def forget(self, url: str) -> None:
        """Nothing to do: aiohttp closes idle connections after its keep-alive timeout."""

    async def close(self) -> None:
        """The session is the caller's."""
