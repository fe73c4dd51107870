"""A trio-style cancel scope for asyncio: cancel one block of one task, with a reason.

Every request runs its upstream exchange inside one scope. Whoever learns that the request
must stop (the client-disconnect watcher, a first-byte or idle deadline, the drain at
shutdown) calls `cancel(reason)`; the block gets `CancelledError` at its current await,
its `finally` clauses close the upstream response, and the scope turns the cancellation
into `ScopeCancelled(reason)` at its edge, so that a cancellation of the whole task (from
the server) is never mistaken for ours and never swallowed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType


class ScopeCancelled(Exception):
    """The scope's block was cancelled on purpose; `reason` says by whom."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CancelScope:
    """Use as `with scope:` around awaits of the current task; `cancel()` from anywhere."""

    __slots__ = (
        "_activity",
        "_cancelling",
        "_entered",
        "_idle_s",
        "_loop",
        "_task",
        "_timer",
        "cancelled_at",
        "reason",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # Given the loop, the scope never asks for it (a getpid() call each on Python 3.11).
        self._loop = loop
        self.reason: str | None = None
        self.cancelled_at: float | None = None
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._entered = False
        self._timer: asyncio.TimerHandle | None = None
        self._idle_s = 0.0
        self._activity: Callable[[], float] | None = None

    def __enter__(self) -> CancelScope:
        task = asyncio.current_task(self._loop)
        if task is None or self._entered:
            raise RuntimeError("a CancelScope is entered once, inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._entered = True
        if self.reason is not None:  # cancelled before it was entered
            task.cancel()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False
        self.clear_deadline()
        if self.reason is None or self._task is None:
            return
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise ScopeCancelled(self.reason) from None

    @property
    def active(self) -> bool:
        return self._entered

    def cancel(self, reason: str) -> None:
        """Stop the block now (idempotent; the first reason wins; no-op once exited)."""
        if self.reason is not None:
            return
        if self._task is not None and not self._entered:
            return  # the block is over: nothing left to cancel
        self.reason = reason
        self.cancelled_at = time.monotonic()
        if self._task is not None:
            self._task.cancel()

    def deadline(self, seconds: float, reason: str) -> None:
        """Cancel with `reason` after `seconds` unless cleared or replaced first."""
        self.clear_deadline()
        loop = self._loop or asyncio.get_running_loop()
        self._timer = loop.call_later(seconds, self.cancel, reason)

    def idle_deadline(self, seconds: float, last_activity: Callable[[], float]) -> None:
        """Cancel with "read_timeout" once `last_activity()` is `seconds` old.

        One timer per period of silence instead of one per chunk: the hot path only stores
        a timestamp, and the timer re-arms itself for the remaining time when it fires early.
        """
        self.clear_deadline()
        loop = self._loop or asyncio.get_running_loop()
        self._idle_s = seconds
        self._activity = last_activity
        self._timer = loop.call_later(seconds, self._check_idle)

    def _check_idle(self) -> None:
        # A method, not a closure that re-arms itself: such a closure refers to its own
        # cell, a reference cycle that would keep every stream's objects for the collector.
        activity = self._activity
        if activity is None:
            return
        remaining = activity() + self._idle_s - time.monotonic()
        if remaining <= 0:
            self._timer = None
            self.cancel("read_timeout")
        else:
            loop = self._loop or asyncio.get_running_loop()
            self._timer = loop.call_later(remaining, self._check_idle)

    def clear_deadline(self) -> None:
        self._activity = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
