"""The contract between the flow controller and every placement policy.

A policy answers one question, now: may this request start, and on which node? It never
waits, never does I/O, and reads time only from its injected clock, so the virtual-time
simulator drives the very same object. Waiting is the flow controller's business
(`kvgate.core.flow`): it asks the policy again whenever room may have been freed.

The lifecycle of an admitted request: `admit()` returns an `Admit` whose ticket holds the
request's claim on one node; the shell reports progress (`on_first_token`, `on_tokens`)
and calls `release()` exactly once when the request ends, however it ends (a second call
is a no-op, so `finally:` blocks may call it freely). Engine samples arrive through
`observe()`, scrape failures through `observe_failure()`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvgate.core.request import AdmissionRequest
from kvgate.core.signals import NodeSample

if TYPE_CHECKING:
    import random

    from kvgate.core.clock import Clock
    from kvgate.core.plan.lengths import OutputLengths
    from kvgate.core.prefix.held import PromptSharing
    from kvgate.core.replicas.claims import Claims
    from kvgate.core.replicas.peers import PeerState


class Outcome(enum.Enum):
    """How an admitted request ended; policies learn from it."""

    DONE = "done"
    CLIENT_CANCEL = "client_cancel"
    UPSTREAM_ERROR = "upstream_error"
    SHUTDOWN = "shutdown"


@dataclass(slots=True, eq=False)
class Ticket:
    """An admitted request's claim on one node. Identity, not value, makes two tickets equal.

    `expected_output` is the output length the envelope assumed when it admitted the
    request; `waited_s` how long it queued first; `key` names its hold inside the policy;
    `route` why it went to its node (`kvgate.core.policies.routing`: `prefix 1536/2048`,
    `headroom`), for the access log.
    """

    request: AdmissionRequest
    node_id: str
    admitted_at: float
    key: str = ""
    expected_output: int = 0
    waited_s: float = 0.0
    first_token_at: float | None = None
    output_tokens: int = 0
    released: bool = False
    route: str = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class Admit:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class PlannedPeak:
    """The plan that found no room for a request, on the candidate that came closest: the
    KV peak planned there with the request and the ceiling it would pass, as fractions of
    the node's capacity, and the usage its engine last reported (None: no gauge)."""

    node_id: str
    peak: float
    ceiling: float
    usage: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node_id,
            "planned_peak": round(self.peak, 4),
            "ceiling": round(self.ceiling, 4),
            "kv_usage": None if self.usage is None else round(self.usage, 4),
        }


@dataclass(frozen=True, slots=True)
class Reject:
    """A refusal.

    `status` 429: no room now (`waitable`: the flow controller may queue the request until
    room frees); 503: no backend can take it now (none fresh, none serves the model); 400:
    it can never be served as sent (larger than any backend holds). `planned`: the plan
    that found no room, when that is the cause.
    """

    status: int
    reason: str
    retry_after_s: float
    message: str
    waitable: bool = False
    planned: PlannedPeak | None = None


Decision = Admit | Reject


@dataclass(frozen=True, slots=True)
class StartEstimate:
    """When a request could start on its best node: `seconds` at the node's recent step
    time, and `soonest_s` at its fastest healthy step time (a lower bound, for deciding that
    a wait cannot be met without mistaking a slow moment for a slow engine). Not `measured`
    when it rests on a prior: the node's pace was never measured, or when something running
    there ends is a guess (its model's output lengths are not learned yet); a request is
    never refused on such an estimate."""

    node_id: str
    seconds: float
    soonest_s: float
    measured: bool = True


class AdmissionPolicy(Protocol):
    """Placement as the flow controller (`kvgate.core.flow`) and its replica exchange
    (`kvgate.core.replicas.exchange`) use it: every member they use, and no other.

    Implemented by `kvgate.core.policies.AdaptivePolicy` (production) and by the
    benchmark's baselines (`kvgate.core.policies.baselines`), all on
    `kvgate.core.policies.base.BasePolicy`.
    """

    @property
    def name(self) -> str: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def rng(self) -> random.Random:
        """The source of the flow controller's jitter too (seeded runs reproduce)."""
        ...

    @property
    def generation(self) -> int:
        """Changes whenever anything a decision depends on changes (a sample, a start, an
        end, the node set, the peers): equal generations give equal answers."""
        ...

    @property
    def lengths(self) -> OutputLengths: ...

    @property
    def claims(self) -> Claims:
        """This replica's claims on each node's slack (while other replicas admit too)."""
        ...

    @property
    def sharing(self) -> PromptSharing:
        """The prompt blocks each node's running requests hold (what a newcomer shares)."""
        ...

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        """Decide now; on Admit the request's footprint is already held on its node.

        `promised[node]` is a time from which that node's room is promised to a request
        already waiting: this one may go there only if it is expected to end by then.
        """
        ...

    def start_estimate(self, request: AdmissionRequest) -> StartEstimate | None:
        """Where and when `request` could start at the earliest, from what runs now; None
        when no candidate can say (no capacity known, or it would not fit even then)."""
        ...

    def shortfall(self, request: AdmissionRequest) -> float:
        """Tokens the candidates must free before `request` fits on the best of them."""
        ...

    def drain_time(
        self, tokens: float, candidates: Sequence[str], fastest: bool = False
    ) -> float | None:
        """Seconds until the candidates have likely freed `tokens` KV tokens (`fastest`: at
        their fastest pace, the soonest they could); None if unknown."""
        ...

    def measured(self, request: AdmissionRequest) -> bool:
        """Do predictions on the request's candidates (its start, their drain) rest on
        measurements alone, not on a prior (see `StartEstimate`)?"""
        ...

    def time_left(self, ticket: Ticket, fastest: bool = False) -> float:
        """Seconds until the ticket's request is expected to end (0 once released);
        `fastest`: at its node's fastest pace, the one a refusal is judged at."""
        ...

    def footprint(self, request: AdmissionRequest, expected: int) -> int:
        """Tokens the request will hold at its end if it produces `expected` tokens."""
        ...

    def on_first_token(self, ticket: Ticket) -> None: ...

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        """The request has now produced `output_tokens` in total."""
        ...

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        """Give back the ticket's hold; idempotent."""
        ...

    def recount(self, ticket: Ticket, request: AdmissionRequest) -> None:
        """The admitted ticket's prompt was counted after it started (`request`: its copy
        with the count and the prompt's ids); its hold takes them."""
        ...

    def observe(self, node_id: str, sample: NodeSample) -> None: ...

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        """A scrape failed; `hard` unless it was abandoned for hanging (`core.nodes`)."""
        ...

    def add_node(self, node_id: str) -> None: ...

    def remove_node(self, node_id: str) -> None: ...

    def set_peers(self, state: PeerState) -> None:
        """The other replicas' state from the last sync (`kvgate.core.replicas.peers`)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for `/admin/state` and the dashboard."""
        ...
