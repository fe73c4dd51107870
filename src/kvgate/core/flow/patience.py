"""Clients' deadlines, said or learned from the ones that left: the queue holds nobody past
theirs.

A client with a timeout leaves a request that has not answered in time, and a client that
retries comes back at once, to the end of the queue: a gateway that holds requests longer
than their clients wait serves nobody (every answer ends after its client left: the
engine's work is lost, and the retries fill the queue). The queue's bound
(`queue.max_wait_s`) is the operator's upper limit; the clients' own deadlines lower it.

**Said.** The OpenAI SDKs send their timeout with every try (`X-Stainless-Timeout` from
the Node SDK, `X-Stainless-Read-Timeout` from the Python one: 600 s unless the caller set
another; `AdmissionRequest.timeout_s`). Either gives up when no byte came back within
it: an answer that is not streamed must end within it, a stream only start, after which
its bytes keep it alive. A proxy in front says the time its route gives the whole answer,
streamed or not (Envoy's `x-envoy-expected-rq-timeout-ms`, from its route timeout:
`AdmissionRequest.answer_timeout_s`). Every answer must begin to arrive a second
(`FIRST_BYTES_S`) before the timeout, a 429 included. So a stream with a read timeout
waits at most that less the second and starts however long it will run; an answer that
must end in time waits at most that less the time it takes, and does not start if it
would end after it.

**Learned.** Other clients say nothing, and their deadline is learned per tenant from
when they leave. Every request that was queued or started ends for its client in one of
two ways: its answer ended `t` seconds after it arrived (a censored observation:
the client would have waited at least `t`), or the client left after `t` seconds, in the
queue or in the middle of its answer (an event: it waited exactly `t`).

**A deadline is a cliff.** Kaplan-Meier's survival curve of those times, over
logarithmic bins, with weights that halve every `HALF_LIFE_S` (clients change), shows
when clients leave. A timeout shows as a cliff at its value: clients stay until it, then
most leave together. People who give up at random moments, or stop an answer once they
have read enough, spread the curve instead. So a tenant's clients have a deadline `D`
only when, once at least `MIN_LEFT` have left, more than half have left by `D`, at
least `CLIFF_DROP` of them in the last `CLIFF_SPAN` of the time before it, and at least
`MIN_LEFT` clients were answered before `D` (they stay until it: clients that cancel
their requests at once, with no answer seen yet, show no deadline); otherwise nothing is
bounded.

**The bound.** A request may wait at most its deadline (its own timeout or its tenant's,
whichever ends first) less the time its answer takes once started (its expected output
length at the seconds per output token measured over the answers that ended), so that
what it waits for ends before its client leaves.
The flow controller refuses at once (429 with the predicted wait as Retry-After) what
cannot start within that, instead of keeping it until its client leaves. A request that
could start now but whose answer would end after the deadline is not started either (429
`client_deadline`): the engine's time goes to answers their clients will read. Its answer
is timed at the seconds per token answers took from start to end (the batch that starts
after it slows it), or at its node's fastest pace (`AdmissionPolicy.time_left`) where
that is slower.

Once the bound holds, fewer clients leave, and what the curve knows beyond the deadline
does not change: the estimate keeps until its evidence has decayed (about four
half-lives), and is learned again if clients still leave then.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from kvgate.core.admission import Outcome, Ticket
from kvgate.core.request import AdmissionRequest

# Waits from 50 ms to an hour, in bins 5% apart.
_LOW_S = 0.05
_RATIO = 1.05
_EDGES = tuple(_LOW_S * _RATIO**i for i in range(round(math.log(72_000) / math.log(_RATIO)) + 1))
MIN_LEFT = 5.0  # weighted count of clients that left before a deadline is learned
CLIFF_SPAN = 0.2  # a deadline's cliff: the last fifth of the time before it ...
CLIFF_DROP = 0.3  # ... in which at least this share of the clients left
HALF_LIFE_S = 300.0
REFRESH_S = 0.25  # a tenant's patience is recomputed at most this often
FIRST_BYTES_S = 1.0  # an answer to a client with a timeout begins this much before it ...
FIRST_BYTES_SHARE = 0.1  # ... or this share of it, when that is less
SPEED_WEIGHT = 0.1  # weight of each answer in the seconds-per-token average
_RESCALE = 2.0**40


@dataclass(slots=True)
class _Curve:
    """One tenant's binned observations (events and censored). Weights decay lazily: an
    observation at `t` weighs `2 ** ((t - origin) / HALF_LIFE_S)`, so older ones weigh
    relatively less, and the sums are rescaled once the weights grow large."""

    left: list[float] = field(default_factory=lambda: [0.0] * (len(_EDGES) + 1))
    stayed: list[float] = field(default_factory=lambda: [0.0] * (len(_EDGES) + 1))
    origin: float | None = None
    total_left: float = 0.0
    cached: float | None = None  # the deadline as of `computed_at`
    computed_at: float = -math.inf

    def add(self, waited: float, left: bool, now: float) -> None:
        weight = self._weight(now)
        index = bisect.bisect_right(_EDGES, max(0.0, waited))
        (self.left if left else self.stayed)[index] += weight
        if left:
            self.total_left += weight
            self.computed_at = -math.inf  # a departure may move the cliff at once

    def evidence(self, now: float) -> float:
        """How many clients have left, decayed to `now`."""
        return self.total_left / self._weight(now)

    def deadline(self, now: float) -> float | None:
        """The time by which more than half of the clients have left, when they leave
        together (a cliff, see the module); None otherwise."""
        if now - self.computed_at < REFRESH_S:
            return self.cached
        self.computed_at = now
        self.cached = None
        if self.evidence(now) < MIN_LEFT:
            return None
        at_risk = sum(self.left) + sum(self.stayed)
        survival = 1.0
        curve: list[float] = []  # survival at the end of each bin
        for index, (gone, stayed) in enumerate(zip(self.left, self.stayed, strict=True)):
            if gone and at_risk > 0:
                survival *= 1.0 - gone / at_risk
            curve.append(survival)
            if survival <= 0.5:
                deadline = _EDGES[index - 1] if index else 0.0
                start = bisect.bisect_right(_EDGES, deadline * (1.0 - CLIFF_SPAN))
                before = curve[start - 1] if start else 1.0
                stayed_before = sum(self.stayed[:index]) / self._weight(now)
                if before - survival >= CLIFF_DROP and stayed_before >= MIN_LEFT:
                    self.cached = deadline
                return self.cached
            at_risk -= gone + stayed
        return None

    def _weight(self, now: float) -> float:
        if self.origin is None:
            self.origin = now
        weight = math.pow(2.0, (now - self.origin) / HALF_LIFE_S)
        if weight > _RESCALE:
            self.left = [w / weight for w in self.left]
            self.stayed = [w / weight for w in self.stayed]
            self.total_left /= weight
            self.origin, weight = now, 1.0
        return weight


class Patience:
    """Per tenant, its clients' deadline, where they have one (see the module)."""

    def __init__(self) -> None:
        self._curves: dict[str, _Curve] = {}
        self.seconds_per_token: float | None = None  # answers' duration per output token

    def left(self, tenant: str, waited: float, now: float) -> None:
        """A client left `waited` seconds after it arrived, before its answer ended."""
        self._curve(tenant).add(waited, True, now)

    def answered(self, tenant: str, waited: float, now: float) -> None:
        """A client's answer ended `waited` seconds after it arrived."""
        self._curve(tenant).add(waited, False, now)

    def ended(self, ticket: Ticket, outcome: Outcome, now: float) -> None:
        """An admitted request ended: what its client showed, and its answer's speed."""
        since = now - (ticket.admitted_at - ticket.waited_s)
        tenant = ticket.request.tenant
        if outcome is Outcome.CLIENT_CANCEL:
            self.left(tenant, since, now)
        elif outcome is Outcome.DONE:
            self.answered(tenant, since, now)
            if ticket.output_tokens > 0:
                speed = (now - ticket.admitted_at) / ticket.output_tokens
                known = self.seconds_per_token
                self.seconds_per_token = (
                    speed if known is None else known + SPEED_WEIGHT * (speed - known)
                )

    def deadline(self, tenant: str, now: float) -> float | None:
        """The tenant's clients' deadline (seconds after arrival); None while they show
        none."""
        curve = self._curves.get(tenant)
        return None if curve is None else curve.deadline(now)

    def bounds(self, request: AdmissionRequest, now: float) -> bool:
        """Whether a deadline bounds `request`: a timeout it carries (its client's or its
        proxy's), or its tenant's."""
        said = request.timeout_s is not None or request.answer_timeout_s is not None
        return said or self.deadline(request.tenant, now) is not None

    def bound(self, request: AdmissionRequest, expected_output: int, now: float) -> float | None:
        """The longest `request`, expecting `expected_output` tokens, should wait so that
        its client still reads its answer; None: no deadline. Its first bytes must come
        before its own timeout, and its answer end before its deadline (at the seconds per
        token answers took)."""
        limits = []
        own = _before(request.timeout_s)
        if own is not None and request.stream:
            limits.append(own)
        deadline = self.answer_deadline(request, now)
        if deadline is not None:
            limits.append(deadline - (self.seconds_per_token or 0.0) * expected_output)
        return max(0.0, min(limits)) if limits else None

    def answer_deadline(self, request: AdmissionRequest, now: float) -> float | None:
        """By when, after its arrival, `request`'s answer must have ended: before its own
        timeout unless it streams, before its proxy's, or by its tenant's clients' learned
        deadline, whichever comes first; None when none bounds it."""
        learned = self.deadline(request.tenant, now)
        own = _before(_whole(request))
        if own is None or learned is None:
            return own if learned is None else learned
        return min(own, learned)

    def late(self, ticket: Ticket, waited: float, time_left: float, deadline: float) -> str | None:
        """Why `ticket`, starting after `waited` s with its answer expected to take
        `time_left` s at its node's fastest pace, should not start: it would end after
        `deadline` (its `answer_deadline`); None when it may. Its answer takes at least its
        expected output at the seconds per token that answers took from their start to
        their end: a node's step now is no answer's pace, which the prefills of the
        requests that start after it slow, and which a long prefill running now slows only
        for a while."""
        answer = (self.seconds_per_token or 0.0) * ticket.expected_output
        ends_s = waited + max(time_left, answer)
        if ends_s <= deadline:
            return None
        timeout = _whole(ticket.request)
        if timeout is not None and deadline == _before(timeout):
            return _LATE_TIMEOUT.format(ends=ends_s, deadline=timeout)
        return _LATE.format(ends=ends_s, deadline=deadline)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "seconds_per_token": self.seconds_per_token,
            "tenants": {
                tenant: {"deadline_s": curve.deadline(now), "left": round(curve.evidence(now), 1)}
                for tenant, curve in sorted(self._curves.items())
            },
        }

    def _curve(self, tenant: str) -> _Curve:
        curve = self._curves.get(tenant)
        if curve is None:
            curve = self._curves[tenant] = _Curve()
        return curve


def _whole(request: AdmissionRequest) -> float | None:
    """The timeout said for `request`'s whole answer: its proxy's, or its client's own
    unless it streams (a stream's bytes keep it alive), whichever is shorter."""
    own = None if request.stream else request.timeout_s
    proxy = request.answer_timeout_s
    return proxy if own is None else own if proxy is None else min(own, proxy)


def _before(timeout: float | None) -> float | None:
    """When an answer to a client whose own timeout is `timeout` must have begun to arrive:
    `FIRST_BYTES_S` before it (a tenth of it, when less), so that even a 429 reaches the
    client before it gives up."""
    return None if timeout is None else timeout - min(FIRST_BYTES_S, timeout * FIRST_BYTES_SHARE)


_LATE_TIMEOUT = (
    "At the backends' current pace this answer would end about {ends:.0f} s after the"
    " request arrived, after the timeout of {deadline:.1f} s the request carries; retry"
    " later."
)
_LATE = (
    "At the backends' current pace this answer would end about {ends:.0f} s after the"
    " request arrived, and this tenant's clients leave after {deadline:.1f} s; retry later."
)
