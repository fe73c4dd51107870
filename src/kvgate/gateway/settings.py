"""Settings of the I/O shell: where to listen, how to talk upstream, input limits."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on.")
    server: Literal["uvicorn", "hypercorn"] = Field(
        "uvicorn", description="ASGI server: uvicorn (HTTP/1.1, fastest) or hypercorn (HTTP/2)."
    )
    certfile: str | None = Field(None, description="TLS certificate (enables HTTPS, h2 via ALPN).")
    keyfile: str | None = Field(None, description="TLS private key.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight streams may finish."
    )
    log_level: str = Field("info", description="Log level.")
    access_log: bool = Field(
        True, description="Write one JSON line per request to the `kvgate.access` logger."
    )
    admin_token: str | None = Field(
        None,
        description="Bearer token that `POST /admin/signals` and `POST /admin/reload` require"
        " (both are refused while it is unset).",
    )


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    first_byte_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for upstream response headers."
    )
    read_timeout_s: float = Field(
        60.0, gt=0, description="Longest silence allowed between two upstream chunks."
    )


class LimitSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger bodies get 413.")
    client_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A client must send its whole request (headers and body) within this; "
        "slower ones get 408.",
    )
    max_connections: int = Field(
        4096,
        gt=0,
        description="Open client connections at most; more get 503 + Retry-After at once.",
    )
