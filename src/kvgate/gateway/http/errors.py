"""OpenAI-shaped errors: what every client SDK knows how to read.

Every failure the gateway itself produces, whether bad input, shedding or an upstream fault,
is rendered here as `{"error": {"message", "type", "param", "code"}}`, so that the official
`openai` package raises its usual typed exception instead of choking on an HTML page or a
traceback.

One vocabulary: `code` is a string, and every such answer carries it again in the header
`X-Kvgate-Reason` (and the access log in `reason`). The header is how a client tells an
answer of kvgate's from an engine's: what an engine answers, errors included, is relayed as
the engine sent it, without the header. The codes and what each means: the tables of
docs/operating.md, which a test checks against the code.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from kvgate.gateway.http.asgi import Send

Headers = list[tuple[bytes, bytes]]

#: The `type` OpenAI uses for each status this gateway emits.
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error the gateway answers itself, before anything was sent to the client: its
    status, message, `code` (also its `X-Kvgate-Reason`), `param` and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = list(headers)


class UpstreamError(Exception):
    """The upstream failed; `kind` labels the metric (connect, reset, timeout, status)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamConnectError(UpstreamError):
    """Refused or reset before any response byte: safe to retry on another backend."""


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """The JSON body of an OpenAI-style error."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "server_error"),
                "param": param,
                "code": code,
            }
        }
    )


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """The final SSE event a stream gets when its upstream fails after headers were sent.

    The stream already answered 200, so the error travels in-band: an `event: error` line
    (for SSE-aware clients) with the OpenAI error JSON as its data (for the `openai` SDK,
    which raises on a data object carrying `error`).
    """
    return b"event: error\ndata: " + error_body(status, message, code) + b"\n\n"


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Send a complete JSON response in two ASGI messages."""
    out: Headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: GatewayError, request_id: bytes | None = None) -> None:
    """Answer with `error`: its status, headers, `X-Kvgate-Reason` and OpenAI body."""
    headers = [*error.headers, (b"x-kvgate-reason", error.code.encode("latin-1", "replace"))]
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    body = error_body(error.status, error.message, error.code, error.param)
    await send_json(send, error.status, body, headers)
