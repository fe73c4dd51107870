"""A configured engine as the gateway sees it: id, URLs, dialect, adapter, credentials."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from kvgate.adapters import adapter_for
from kvgate.adapters.base import EngineAdapter
from kvgate.adapters.settings import BackendSettings, http_url

_DEFAULT_METRICS_PATH = {"trtllm": "/prometheus/metrics"}
_TRITON_METRICS_PORT = 8002


@dataclass(frozen=True, slots=True)
class Backend:
    """One engine node. `adapter` is this node's own (stateful) adapter instance."""

    node_id: str
    base_url: str
    metrics_url: str
    engine: str
    adapter: EngineAdapter = field(compare=False)
    api_key: str | None = field(default=None, repr=False)
    #: The configured KV capacity (for dialects whose page lacks it): part of equality, so
    #: that a reload which changes only this replaces the node's adapter.
    capacity_tokens: int | None = None
    #: The engine's KV event publisher (`kvgate.gateway.engines.kv_events`), if any.
    kv_events: str | None = None

    @classmethod
    def from_settings(cls, settings: BackendSettings) -> Backend:
        base_url = http_url(settings.url)
        return cls(
            node_id=settings.name or host_port(base_url),
            base_url=base_url,
            metrics_url=settings.metrics_url or default_metrics_url(base_url, settings.engine),
            engine=settings.engine,
            adapter=adapter_for(settings.engine, capacity_tokens=settings.kv_capacity_tokens),
            api_key=settings.api_key,
            capacity_tokens=settings.kv_capacity_tokens,
            kv_events=settings.kv_events,
        )

    def auth_headers(self) -> Mapping[str, str]:
        """Headers for calls to the engine itself (metrics, abort); empty without a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def unique(backends: list[Backend]) -> list[Backend]:
    """`backends`, checked for node ids used twice (a configuration error)."""
    seen: set[str] = set()
    for b in backends:
        if b.node_id in seen:
            raise ValueError(f"two backends share the node id {b.node_id!r}: give them names")
        seen.add(b.node_id)
    return backends


def host_port(url: str) -> str:
    """`host:port` of a URL, with the scheme's default port when none is given."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


def default_metrics_url(base_url: str, engine: str) -> str:
    """Where each dialect serves Prometheus text by default.

    Engines serve it beside their API at `/metrics`, except trtllm-serve
    (`/prometheus/metrics`) and Triton (its own port, 8002, at the host root).
    """
    if engine == "triton":
        parts = urlsplit(base_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        return urlunsplit((parts.scheme, f"{host}:{_TRITON_METRICS_PORT}", "/metrics", "", ""))
    return base_url + _DEFAULT_METRICS_PATH.get(engine, "/metrics")
