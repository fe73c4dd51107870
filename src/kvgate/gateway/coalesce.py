"""One write per whole response: a response's head waits for its body.

ASGI sends a response in two messages, `http.response.start` and `http.response.body`, and
uvicorn writes each at once: two `send()` system calls per answer, and two wake-ups of the
client, which sees the head arrive alone. On loopback TCP a small write costs about as
much as kvgate's whole relay of a request, because the kernel delivers the segment to the
peer inside the call. kvgate answers most requests whole (non-streaming answers, every
429, every error), so the head and the body are sent within one step of the request's
task.

`HeadCork` stands between one request's uvicorn cycle and its connection. It holds the
response head and writes it together with the next write, the body's. If no body follows
within the current turn of the event loop (a stream whose first event is still being
generated), the head goes out alone at the end of that turn: nothing waits longer than
it would have for the loop to come back to it. Informational heads (`100 Continue`) are
never held: the client waits for them before it sends its body.

Only the head is held, never body bytes, so a streamed event reaches the client as soon
as it did before. nginx does the same (it sends a small response's head and body in one
`writev`).
"""

from __future__ import annotations

import asyncio
from typing import Any

_INFORMATIONAL = b"HTTP/1.1 1"


class HeadCork:
    """A write-through view of a connection's transport that holds one response head."""

    __slots__ = ("_armed", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._armed = True  # the next non-informational write is the response's head

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._armed and not data.startswith(_INFORMATIONAL):
            self._armed = False
            self._held = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a held head now (the end of the loop's turn, or the connection closing)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)
