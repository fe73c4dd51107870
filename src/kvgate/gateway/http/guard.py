"""Input limits at the connection level: header size, slow clients, connection count.

uvicorn with httptools (kvgate's fastest HTTP/1.1 stack) has none of these: llhttp accepts
headers of any size, no timer runs while a request is being read (uvicorn's keep-alive
timeout starts only after a response), and `limit_concurrency` answers in plain text.
A client could therefore hold a connection forever by sending one header byte a minute,
or make the server buffer megabytes of headers. `GuardedHttpToolsProtocol` closes those
gaps with three checks that cost one timer per request and a length sum per header:

- **Header size.** The request line and headers together may be at most
  `MAX_HEADER_BYTES`; beyond that the client gets 431 and the connection is closed.
- **Read deadline.** From a connection's first byte (or its opening) until the whole
  request, body included, has arrived: at most `CLIENT_TIMEOUT_S`. A slower client
  gets 408 and is disconnected (the relay sees `http.disconnect` and releases everything).
  The deadline ends when the request is read, so long streamed answers are not affected.
- **Connection count.** Beyond `MAX_CONNECTIONS` open connections a new one gets
  503 with `Retry-After: 1` and is closed at once, before it can cost anything else.
- **Lingering close.** An answer that ends the connection while the client is still
  sending its body (413 to a client that asked to close, 431) is followed by a
  half-close, and the rest of what the client sends is read and thrown away until it
  closes its side, falls silent for `LINGER_IDLE_S` or `LINGER_S` have passed; only then
  is the socket closed. Many clients write the whole body before they read anything;
  closing a socket with unread data makes the kernel send a reset, and the client sees
  "connection reset" or "broken pipe" instead of the answer (nginx's `lingering_close`
  exists for the same reason). A client that keeps the connection alive has the rest of
  its body read and discarded by the parser instead, within the read deadline.

Every answer is OpenAI-shaped JSON. The body size limit (413) and `max_tokens` (400) are
checked by the relay, which knows the route. With hypercorn the header size maps to its
`h11_max_incomplete_size` and `h2_max_header_list_size` (see `hypercorn_limits`); it has no
read deadline that would not also cut long streams, so the slow-client guard is uvicorn's;
the lingering close is uvicorn's too.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvgate.gateway.http.disconnect import EXTENSION, DisconnectSignal, signal_of
from kvgate.gateway.http.errors import error_body
from kvgate.gateway.http.splice import EXTENSION as SPLICE
from kvgate.gateway.http.splice import ClientWriter, Splicer

#: Request line and headers together, at most. An API call's headers (a key, a content
#: type, a few tracing ids) take well under 2 KiB; 32 KiB is twice what Node.js accepts and
#: as much as nginx's default buffers hold, room for large cookies or tokens an ingress
#: adds, while a client still cannot make the server buffer megabytes of headers.
MAX_HEADER_BYTES = 32 * 1024
#: A client must send its whole request, headers and body, within this. An API client on a
#: data-centre or office link sends even the largest allowed body (`limits.max_body_bytes`,
#: 4 MiB) in well under a second, and at 30 s one on a 1.2 Mbit/s link still does; only a
#: client that stalls (or trickles bytes on purpose) is cut.
CLIENT_TIMEOUT_S = 30.0
#: Open client connections at most. It bounds the memory and file descriptors that idle or
#: trickling connections can hold; honest load never reaches it, since one event loop
#: streams far fewer requests at once than this and admission sheds long before.
MAX_CONNECTIONS = 4096

log = logging.getLogger(__name__)

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Unavailable"}
# Lingering close: nginx's defaults (`lingering_time`, `lingering_timeout`). At most this long
# in all, a budget ample for a client that sends its body at full speed and then reads.
LINGER_S = 30.0
# ...and the socket is closed once the client has sent nothing for this long.
LINGER_IDLE_S = 5.0


def raw_error(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = error_body(status, message, code)
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"x-kvgate-reason: %s\r\nconnection: close\r\n"
        % (status, _REASONS.get(status, b"Error"), len(body), code.encode())
    )
    if status == 503:
        head += b"retry-after: 1\r\n"
    return head + b"\r\n" + body


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The guard's limits: constants, not configuration (each argued above); tests
    shorten them to see them work."""

    client_timeout_s: float = CLIENT_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus kvgate's connection-level input limits."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    #: How many requests each guard refused, for tests and logs: {"431": n, ...}.
    refused: ClassVar[dict[str, int]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_too_large = False
        self._deadline: asyncio.TimerHandle | None = None
        self.waiting_writers: list[ClientWriter] = []
        self._splicer = Splicer(self)
        # Lingering close (see the module's docstring): when it ends at the latest, when
        # the client last sent something, and the timer that checks.
        self._linger_until: float | None = None
        self._linger_heard = 0.0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._cycle_transport: _CycleTransport | None = None  # made with the connection

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
        """A subclass bound to `limits` (uvicorn instantiates the class itself)."""
        return type(cls.__name__, (cls,), {"limits": limits, "refused": {}})

    # ---- connection --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._cycle_transport = _CycleTransport(self)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "Too many open connections; retry shortly.", "too_many_connections")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._splicer.detach()  # it refers to this protocol: no cycle left to collect
        super().connection_lost(exc)
        # Tell the relay at once (see kvgate.gateway.http.disconnect): the request in progress
        # and any pipelined behind it lost their client.
        cycles = [self.cycle] if self.cycle is not None else []
        cycles += [cycle for cycle, _ in self.pipeline]
        for cycle in cycles:
            if not cycle.response_complete:
                signal = signal_of(cycle.scope)  # type: ignore[arg-type]
                if signal is not None:
                    signal.fire()

    def data_received(self, data: bytes) -> None:
        if self._linger_until is not None:
            self._linger_heard = self.loop.time()  # thrown away, unparsed
            return
        super().data_received(data)

    # ---- parser callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        if self._deadline is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # Before uvicorn builds the request's cycle around this very scope dict and starts
        # its task (see kvgate.gateway.http.splice for the writer).
        # kvgate's own extensions are objects, not the dicts ASGI's typing declares.
        extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))
        extensions[EXTENSION] = DisconnectSignal()
        extensions[SPLICE] = self._splicer
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and self._cycle_transport is not None:
            # Duck-typed: the cycle only writes, asks is_closing and closes.
            cycle.transport = cast(asyncio.Transport, self._cycle_transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        # Spliced streams paused their engine's connection until now (see splice.py).
        waiting = self.waiting_writers[:]
        self.waiting_writers.clear()  # in place: the writers hold this very list
        for writer in waiting:
            writer.writable()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._linger_until is not None:
            self._unset_keepalive_if_required()  # the linger has bounds of its own

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error; ours when the error was our header limit."""
        if self._head_too_large:
            message = f"Request headers exceed {MAX_HEADER_BYTES} bytes."
            self._refuse(431, message, "headers_too_large", linger=True)
            return
        self._refuse(400, "Invalid HTTP request.", "invalid_http")

    # ---- helpers -----------------------------------------------------------------------

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEADER_BYTES:
            self._head_too_large = True
            raise ValueError("request headers too large")  # httptools: a parser error

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.client_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        """The request was not fully read in time: 408 if nothing was answered yet."""
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()
            return
        self._refuse(408, "The request was not received in time.", "request_timeout")

    def _refuse(self, status: int, message: str, code: str, *, linger: bool = False) -> None:
        self._disarm()
        key = str(status)
        self.refused[key] = self.refused.get(key, 0) + 1
        if not self.transport.is_closing():
            self.transport.write(raw_error(status, message, code))
            if linger:
                self.linger()
            else:
                self.transport.close()

    # ---- lingering close ---------------------------------------------------------------

    def linger(self) -> None:
        """End the connection without losing the answer just written: half-close, then
        read and discard what the client still sends, within bounds; then close."""
        transport = self.transport
        if transport.is_closing() or self._linger_until is not None:
            return
        self._disarm()
        now = self.loop.time()
        self._linger_until = now + LINGER_S
        self._linger_heard = now
        if transport.can_write_eof():  # not over TLS: the answer then ends by its length
            transport.write_eof()
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_IDLE_S, self._linger_check)

    def _linger_check(self) -> None:
        until = self._linger_until
        assert until is not None
        now = self.loop.time()
        idle_end = self._linger_heard + LINGER_IDLE_S
        if now >= until or now >= idle_end:
            self._linger_timer = None
            self.transport.close()
            return
        self._linger_timer = self.loop.call_at(min(until, idle_end), self._linger_check)


class _CycleTransport:
    """The connection as its requests' cycles see it: uvicorn closes it after an answer
    with `connection: close`; while the latest request's body is still arriving, the
    protocol lingers instead (`GuardedHttpToolsProtocol.linger`). Writes go straight
    through. One per connection; it holds its protocol weakly, so that no reference cycle
    outlives the connection."""

    __slots__ = ("_protocol", "_transport", "is_closing", "write")

    def __init__(self, protocol: GuardedHttpToolsProtocol) -> None:
        self._protocol = weakref.ref(protocol)
        self._transport: asyncio.Transport = protocol.transport
        self.write = self._transport.write
        self.is_closing = self._transport.is_closing

    def close(self) -> None:
        protocol = self._protocol()
        cycle = None if protocol is None else protocol.cycle
        if protocol is not None and cycle is not None and cycle.more_body:
            protocol.linger()  # the client may be writing its body still
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardCollector(Collector):
    """`kvgate_connections_refused_total{status}`: what the guards turned away (408, 431,
    503, 400), read from the protocol class when `/metrics` is scraped."""

    def __init__(self, protocol: type[GuardedHttpToolsProtocol]) -> None:
        self._protocol = protocol

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvgate_connections_refused",
            "Connections answered and closed by the input guards, by status.",
            labels=["status"],
        )
        for status, count in sorted(self._protocol.refused.items()):
            family.add_metric([status], count)
        yield family


def hypercorn_limits(config: Any) -> None:
    """The parts of the limits hypercorn can enforce itself."""
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    config.h2_max_header_list_size = MAX_HEADER_BYTES
