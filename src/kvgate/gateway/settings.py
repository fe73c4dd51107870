"""Settings of the I/O shell: where to listen, how to talk upstream, input limits."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The log levels `server.log_level` takes (any case), most verbose first.
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    listen: str = Field(
        "127.0.0.1:8080",
        description="`HOST:PORT` to listen on (IPv6 in brackets: `[::]:8080`; port 0: any"
        " free one); `--host` and `--port` change one half of it.",
    )
    server: Literal["uvicorn", "hypercorn"] = Field(
        "uvicorn",
        description="ASGI server: uvicorn (HTTP/1.1, half hypercorn's CPU per request) or"
        " hypercorn (HTTP/2 too: h2c, or h2 over TLS).",
    )
    certfile: str | None = Field(None, description="TLS certificate (enables HTTPS, h2 via ALPN).")
    keyfile: str | None = Field(None, description="TLS private key.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight streams may finish."
    )
    log_level: LogLevel = Field(
        "info",
        description="Log level: `debug`, `info`, `warning`, `error` or `critical`; the"
        " access log (a line per request) is `info`.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="`text` (for a terminal) or `json` (an object per line, for log"
        " collectors): kvgate's lines, the HTTP server's and the access log alike.",
    )
    admin_token: str | None = Field(
        None,
        description="Token of the admin routes (`/admin/*`, `/dashboard`), as a bearer"
        " token or HTTP Basic password: when set, every one of them needs it. While it is"
        " unset `POST /admin/signals` and `POST /admin/reload` are refused, and the others"
        " are open only without API keys.",
    )
    metrics_listen: str | None = Field(
        None,
        description="`HOST:PORT` where `/metrics` is served instead of the main address"
        " (e.g. `0.0.0.0:9464` for Prometheus inside the cluster): the address clients use"
        " then has no `/metrics`.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            listen_address(value)
        return value

    @property
    def address(self) -> tuple[str, int]:
        """`listen` as (host, port)."""
        return listen_address(self.listen)

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("TLS needs both certfile and keyfile")
        return self


def listen_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); an IPv6 host in brackets (`[::]:8080`), port 0 for any
    free one. ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    valid = sep and host and port.isdigit() and int(port) <= 65535
    if not valid or bracketed != (":" in host):
        raise ValueError(f"{text!r} is not HOST:PORT (e.g. 0.0.0.0:8080, [::]:8080 for IPv6)")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    """(host, port) as `HOST:PORT`, an IPv6 host in brackets: the inverse of `listen_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def local_url(host: str, port: int, *, tls: bool = False) -> str:
    """The base URL that reaches a gateway listening on (host, port) from the same machine:
    a wildcard address (`0.0.0.0`, `::`) is reached through loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"{'https' if tls else 'http'}://{join_address(host, port)}"


#: How many read timeouts an engine may take to send its response headers. Before them it
#: is silent while the request waits in its queue and, for a non-streamed answer, while it
#: generates the whole answer: ten silences (10 minutes at the default) cover a long
#: non-streamed generation (30k tokens at 50 tokens/s), and an operator who shortens the
#: read timeout to find hung engines sooner shortens this wait with it.
FIRST_BYTE_SILENCES = 10


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    read_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest silence allowed between two upstream chunks; for the response"
        " headers, 10 times this (a non-streamed answer comes whole, at its end).",
    )

    @property
    def first_byte_timeout_s(self) -> float:
        """How long to wait for the upstream's response headers."""
        return FIRST_BYTE_SILENCES * self.read_timeout_s


class LimitSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger bodies get 413.")
