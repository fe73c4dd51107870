"""Reading a request body from ASGI `receive`: the one reader every route uses.

The body is read whole, and never past its limit: a declared `Content-Length` above it is
refused before anything is read, and a body that grows past it while it arrives is refused
at the chunk that crossed it (413 either way). A client that leaves before its body has
arrived raises `ClientGone`: there is nobody left to answer.
"""

from __future__ import annotations

from kvgate.gateway.http.asgi import Receive
from kvgate.gateway.http.errors import GatewayError


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


def too_large(limit: int) -> GatewayError:
    """The 413 of a body larger than `limit` bytes."""
    return GatewayError(413, f"The request body is larger than {limit} bytes.", "request_too_large")


async def read_body(receive: Receive, limit: int, declared: int | None = None) -> bytes:
    """The whole body, at most `limit` bytes; `declared` is its `Content-Length`, if sent."""
    if declared is not None and declared > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        more = message.get("more_body", False)
        if not more and not parts:  # the usual case: the body came in one message
            return chunk
        parts.append(chunk)
        if not more:
            return b"".join(parts)
