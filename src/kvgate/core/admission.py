"""The contract between the I/O shell and every admission policy.

The shell asks `admit()` before it sends a request upstream, tells the policy about the
request's progress, and calls `release()` exactly once when the request ends, however it
ends (a second call is a no-op, so `finally:` blocks can call it freely). The shell feeds
engine samples in through `observe()` and scrape failures through `observe_failure()`.

A policy never does I/O, never sleeps and reads time only from its injected clock, so
the virtual-time simulator can drive the very same object.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.core.request import Priority, RequestCost
from kvgate.core.signals import NodeSample


class Outcome(enum.Enum):
    """How an admitted request ended; policies may learn from it."""

    DONE = "done"
    CLIENT_CANCEL = "client_cancel"
    UPSTREAM_ERROR = "upstream_error"
    SHUTDOWN = "shutdown"


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request's claim on one node. Identity, not value, makes two tickets equal."""

    request_id: str
    node_id: str
    cost: RequestCost
    priority: Priority
    admitted_at: float
    first_token_at: float | None = None
    output_tokens: int = 0
    released: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Admit:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Reject:
    """A refusal. `status` is 429 (shed: try later) or 503 (no backend can serve at all)."""

    status: int
    reason: str
    retry_after_s: float
    message: str


Decision = Admit | Reject


class AdmissionPolicy(Protocol):
    """One small interface, several implementations (none, static-qps, ..., adaptive)."""

    name: str

    def admit(
        self,
        request_id: str,
        cost: RequestCost,
        priority: Priority,
        candidates: Sequence[str],
    ) -> Decision:
        """Decide now, without waiting; on Admit the cost is already reserved on a node."""
        ...

    def on_first_token(self, ticket: Ticket) -> None: ...

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        """The request has now produced `output_tokens` in total (streaming only)."""
        ...

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        """Give back the ticket's reservation; idempotent."""
        ...

    def observe(self, node_id: str, sample: NodeSample) -> None: ...

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        """A scrape failed; `hard` unless it was abandoned for hanging (`core.nodes`)."""
        ...

    def add_node(self, node_id: str) -> None: ...

    def remove_node(self, node_id: str) -> None: ...

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for `/admin/state` and the dashboard."""
        ...
