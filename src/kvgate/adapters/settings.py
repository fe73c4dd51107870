"""Which engines kvgate fronts and how it watches them."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EngineKind = Literal["vllm", "sglang", "trtllm", "triton", "tgi", "llamacpp"]


class BackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the engine's OpenAI-compatible server.")
    engine: EngineKind = Field("vllm", description="Engine dialect (metrics and abort API).")
    name: str | None = Field(None, description="Node id in metrics and logs (default: host:port).")
    metrics_url: str | None = Field(None, description="Metrics page (default: URL + /metrics).")
    api_key: str | None = Field(
        None, description="Bearer token sent upstream (never logged, never a client key)."
    )
    kv_capacity_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "KV capacity in tokens, for engines whose metrics do not say "
            "(TGI: --max-batch-total-tokens; llama.cpp: --ctx-size). Ignored when the page has it."
        ),
    )
    kv_events: str | None = Field(
        None,
        description=(
            "The engine's KV event publisher (vLLM --kv-events-config), `tcp://host:port`,"
            " with `?replay=tcp://host:port` for its replay socket: routing by prefix cache."
        ),
    )
    discover: Literal["static", "dns"] = Field(
        "static",
        description=(
            "`dns`: the URL's host name stands for a set of engines (a Kubernetes headless"
            " Service): each IPv4 address it resolves to is one backend, `name@address:port`."
        ),
    )

    @field_validator("url", "metrics_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            http_url(value)
        return value

    @field_validator("kv_events")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("tcp", "ipc"):
            raise ValueError(f"{value!r} is not a ZMQ endpoint: expected tcp://host:port")
        return value

    @model_validator(mode="after")
    def _discovered_over_http(self) -> BackendSettings:
        # A pod's certificate names the service, not the pod address kvgate would dial.
        if self.discover == "dns" and urlsplit(self.url).scheme != "http":
            raise ValueError("`discover: dns` needs an http:// URL (TLS names the service)")
        return self


def http_url(url: str) -> str:
    """`url` without its trailing slash; a ValueError unless it is http(s)://host[...]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not a URL: expected http(s)://host[:port][/path]")
    return url.rstrip("/")


class ScrapeSettings(BaseModel):
    """How often engines are polled. How long a poll may take, and how polling backs off
    from a slow page, follow from `admission.stale_after_s` (`gateway.engines.scraper`);
    vLLM nodes are polled on the narrowed page once a check shows it carries every
    metric kvgate reads."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(
        0.05,
        ge=0.02,
        le=1.0,
        description="Period of the polls of each engine's metrics page (longer while the"
        " page is slow to answer).",
    )
