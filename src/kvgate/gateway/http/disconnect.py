"""How the relay learns that its client left: told by the server, or by watching for it.

ASGI's only portable way is a task per request that waits on `receive()` for
`http.disconnect`. That task is created, scheduled, cancelled and awaited for every request,
even the great majority whose client stays: a few tens of microseconds each, a tenth of
what kvgate spends on a small request. kvgate's own HTTP/1.1 protocol (`guard.py`) knows
the moment a connection is lost, so it puts a `DisconnectSignal` in each request's
`scope["extensions"]` and fires it from `connection_lost`: the relay subscribes a callback
and needs no task. Servers without the extension (hypercorn, for HTTP/2 stream resets) get
the watcher task, with the same callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvgate.gateway.http.asgi import Receive, Scope

#: The key of the signal in `scope["extensions"]`.
EXTENSION = "kvgate.disconnect"


class DisconnectSignal:
    """Fired once by the server when the request's connection is lost."""

    __slots__ = ("_callback", "lost")

    def __init__(self) -> None:
        self.lost = False
        self._callback: Callable[[], None] | None = None

    def fire(self) -> None:
        if self.lost:
            return
        self.lost = True
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the client leaves; at once if it already has."""
        if self.lost:
            callback()
        else:
            self._callback = callback

    def unsubscribe(self) -> None:
        self._callback = None


def signal_of(scope: Scope) -> DisconnectSignal | None:
    extensions = scope.get("extensions")
    return extensions.get(EXTENSION) if extensions else None


async def watch_disconnect(receive: Receive, on_gone: Callable[[], None]) -> None:
    """The portable way, as a task owned by the request: `receive()` until the client
    leaves (after the body, an ASGI server answers `receive()` only with a disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_gone()
            return


def watch(
    scope: Scope,
    receive: Receive,
    on_gone: Callable[[], None],
    loop: asyncio.AbstractEventLoop,
) -> DisconnectSignal | asyncio.Task[None]:
    """Start listening for the client's departure; pass the result to `stop_watching`."""
    signal = signal_of(scope)
    if signal is not None:
        signal.subscribe(on_gone)
        return signal
    return loop.create_task(watch_disconnect(receive, on_gone))


async def stop_watching(watching: DisconnectSignal | asyncio.Task[None]) -> None:
    if isinstance(watching, DisconnectSignal):
        watching.unsubscribe()
        return
    watching.cancel()
    try:
        await watching
    except asyncio.CancelledError:
        if not watching.cancelled():  # not the watcher's end: this task is being cancelled
            raise
