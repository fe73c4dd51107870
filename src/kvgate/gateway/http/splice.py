"""Streams without a task switch per event: the engine's bytes reach the client from the
upstream socket's own callback.

The portable relay loop wakes the request's task for every read from the engine; the task
then counts the events and awaits ASGI `send()`. Per SSE event that is a future, a task
step through the coroutine chain and a message dict: under callgrind about half of what
kvgate spends per event, more than the counting itself.

When both ends are kvgate's own, the relay joins them instead. kvgate's HTTP/1.1 server
protocol (`guard.py`) offers each request a `Splicer` in
`scope["extensions"]["kvgate.splice"]`, which hands out a `ClientWriter` for a response in
progress, and the upstream client can hand every body read to a
callback (`H1Response.splice`). The callback counts the read's events and writes
it to the client as one chunk of the chunked response, inside the upstream's
`data_received`; the request's task sleeps until the stream ends, is cut, or is cancelled.
The response's head and its end still go through ASGI `send()`, so the server's own
bookkeeping of the response (keep-alive, completion) is untouched.

Back-pressure is kept: when the client's socket buffer passes its high-water mark the
upstream connection stops reading, and it resumes when the server protocol's
`resume_writing` says the client has drained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvgate.gateway.http.asgi import Scope

#: The key of the writer in `scope["extensions"]`.
EXTENSION = "kvgate.splice"


class _Cycle(Protocol):
    """The parts of uvicorn's `RequestResponseCycle` the writer relies on."""

    scope: Scope
    transport: Any
    flow: Any
    disconnected: bool
    response_started: bool
    response_complete: bool
    chunked_encoding: bool | None


class _Server(Protocol):
    """The parts of the server's connection protocol (`guard.py`) the splicer relies on."""

    cycle: Any
    waiting_writers: list[ClientWriter]


class ClientWriter:
    """Writes body chunks of one streamed response straight to its client's connection."""

    __slots__ = ("_cycle", "_on_writable", "_waiting")

    def __init__(self, cycle: _Cycle, waiting: list[ClientWriter]) -> None:
        self._cycle = cycle
        self._waiting = waiting  # the connection's writers waiting for it to drain
        self._on_writable: Callable[[], None] | None = None

    def write(self, data: bytes) -> bool:
        """Send `data` as one chunk; False when the client should be sent nothing more
        until `when_writable`'s callback runs (its buffer is past the high-water mark)."""
        cycle = self._cycle
        if cycle.disconnected or not data:
            return True  # nobody to write to: the relay learns it from the disconnect
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return not cycle.flow.write_paused

    def when_writable(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` once the client has drained (None: forget a pending one)."""
        self._on_writable = callback
        if callback is not None:
            self._waiting.append(self)
        elif self in self._waiting:  # the stream ended while its client was slow
            self._waiting.remove(self)

    def writable(self) -> None:
        """Called by the server when the connection's write buffer has drained."""
        callback, self._on_writable = self._on_writable, None
        if callback is not None:
            callback()


class Splicer:
    """One per client connection, offered to each of its requests: hands out a writer for
    the response in progress.

    Per connection rather than per request, and holding no request: a writer kept in the
    scope would make a reference cycle (scope, writer, cycle, scope) of every request, and
    each finished request would then wait for the garbage collector.
    """

    __slots__ = ("_server",)

    def __init__(self, server: _Server) -> None:
        self._server: _Server | None = server

    def detach(self) -> None:
        """The connection is gone: hand out no more writers (and let it be freed)."""
        self._server = None

    def writer_for(self, scope: Scope) -> ClientWriter | None:
        """A writer for `scope`'s response, or None when its bytes must go through `send()`:
        the response has not started, is not chunked, is over, lost its client, or another
        request's cycle is current (pipelining)."""
        server = self._server
        if server is None:
            return None
        cycle = server.cycle
        if (
            cycle is None
            or cycle.scope is not scope
            or not cycle.response_started
            or cycle.response_complete
            or cycle.chunked_encoding is not True
            or cycle.disconnected
        ):
            return None
        return ClientWriter(cycle, server.waiting_writers)


def writer_for(scope: Scope) -> ClientWriter | None:
    """A `ClientWriter` for this request's response, when its server can splice."""
    extensions = scope.get("extensions")
    splicer = extensions.get(EXTENSION) if extensions else None
    return splicer.writer_for(scope) if splicer is not None else None
