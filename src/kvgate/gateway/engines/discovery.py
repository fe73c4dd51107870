"""Engines found by DNS: one host name that stands for a set of engines.

In Kubernetes a headless Service (`clusterIP: None`) resolves to the addresses of its
ready pods, and that set changes as pods start, fail their readiness probe or go away.
A backend with `discover: dns` names such a host: every IPv4 address it resolves to is
one backend (node id `name@address:port`, `name` defaulting to the host), re-resolved
every `DISCOVER_EVERY_S`. `Discovery` keeps the addresses; the gateway hands each new set
to `Gateway.set_backends`, so a new pod is scraped and served at once and a departed one
gets no new request while its streams finish.

A lookup that fails keeps the addresses it found last: a DNS hiccup must not drain the
cluster (a dead pod kept that way is only a node whose scrapes fail, which the policy
already routes around). The resolver is injectable, for tests that change the set.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from kvgate.adapters.backend import Backend, unique
from kvgate.adapters.settings import BackendSettings

log = logging.getLogger(__name__)

_LOOKUP_TIMEOUT_S = 5.0  # a resolver that hangs must not hold up start or later lookups
#: How often the dns hosts are looked up again. Kubernetes' DNS (CoreDNS) gives its records
#: a 5 s TTL: asking more often returns the cached answer, asking less often leaves a new
#: pod idle (and a departed one asked) for longer.
DISCOVER_EVERY_S = 5.0

#: (host, port) -> the addresses it resolves to, sorted.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """The host's IPv4 addresses, as the system resolver (and its cache) gives them."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return sorted({str(info[4][0]) for info in infos})


def at_address(settings: BackendSettings, address: str) -> Backend:
    """The backend behind one resolved address: its URL, and a metrics URL on the same
    host, point at the address; the rest of the entry (dialect, key, capacity) is shared."""
    parts = urlsplit(settings.url)
    host = parts.hostname or ""
    netloc = f"{address}:{parts.port or 80}"
    metrics_url = settings.metrics_url
    if metrics_url is not None:
        metrics = urlsplit(metrics_url)
        if metrics.hostname == host:
            metrics_url = urlunsplit(metrics._replace(netloc=f"{address}:{metrics.port or 80}"))
    return Backend.from_settings(
        settings.model_copy(
            update={
                "url": urlunsplit(parts._replace(netloc=netloc)),
                "metrics_url": metrics_url,
                "name": f"{settings.name or host}@{netloc}",
                "discover": "static",
            }
        )
    )


class Discovery:
    """The configured backends, with each `discover: dns` entry expanded to the addresses
    its host resolved to last."""

    def __init__(
        self,
        settings: Sequence[BackendSettings],
        resolver: Resolver = resolve_ipv4,
        previous: Discovery | None = None,
    ) -> None:
        self._settings = list(settings)
        self._resolver = resolver
        # Per dns entry (by position): its addresses; an entry unchanged by a reload keeps
        # what it had, so a reload does not drop pods until the next lookup.
        self._addresses: dict[int, list[str]] = {}
        if previous is not None:
            for i, entry in enumerate(self._settings):
                for j, old in enumerate(previous._settings):
                    if entry == old and j in previous._addresses:
                        self._addresses[i] = previous._addresses[j]

    @property
    def dynamic(self) -> bool:
        return any(s.discover == "dns" for s in self._settings)

    @property
    def every_s(self) -> float:
        """How long until the next lookup."""
        return DISCOVER_EVERY_S

    def backends(self) -> list[Backend]:
        """Static entries as they are, dns entries one backend per known address; in the
        configured order. Raises ValueError if two come out with one node id."""
        out: list[Backend] = []
        for i, entry in enumerate(self._settings):
            if entry.discover == "dns":
                out.extend(at_address(entry, address) for address in self._addresses.get(i, []))
            else:
                out.append(Backend.from_settings(entry))
        return unique(out)

    async def refresh(self) -> bool:
        """Look every dns host up again; True if any set of addresses changed."""
        changed = False
        for i, entry in enumerate(self._settings):
            if entry.discover != "dns":
                continue
            parts = urlsplit(entry.url)
            try:
                async with asyncio.timeout(_LOOKUP_TIMEOUT_S):
                    found = await self._resolver(parts.hostname or "", parts.port or 80)
            except (OSError, UnicodeError) as exc:  # TimeoutError is an OSError
                log.warning("discovery: %s did not resolve (%s); keeping its last addresses",
                            parts.hostname, exc)  # fmt: skip
                continue
            if not found:
                log.warning("discovery: %s has no address; keeping its last ones", parts.hostname)
                continue
            if found != self._addresses.get(i):
                self._addresses[i] = found
                changed = True
        return changed
