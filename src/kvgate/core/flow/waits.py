"""Predicted waits: when a request that cannot start now could start, and whether to trust it.

The flow controller (`kvgate.core.flow.controller`) queues a request unless a measured
prediction says it cannot start within its bound. The prediction is the later of two
times: when the request's own best node will have room for it (`AdmissionPolicy
.start_estimate`: the node's envelope at its recent pace, and at its fastest healthy pace),
and, with others waiting ahead, when the candidates will have freed room for those and for
this one (`AdmissionPolicy.drain_time`: what runs there ending at its likely lengths).

The waiters ahead count at their expected footprints (`ahead`): a waiter's prompt, the
policy's overhead and its model's learned output length, never more than its own cap. A
prompt's blocks that its node held already when it was queued count once (`shared`), as
the ends that free room free only what their requests did not share. A
band keeps its waiters' output caps per model (`WaitQueue.outputs`), so this costs a look
per model, not per waiter (a model's waiters count at most its count times its length).

The soonest of a prediction, which a refusal is judged by, takes both at the nodes' fastest
pace (`Pace.fastest_step_s`). A prediction is `measured` only when nothing in it is a
prior: the pace of the nodes is measured, no request running on them or waiting ahead has
a length still to be learned, and something runs there to predict the drain from.
Otherwise the request waits, and is refused once its deadline really passes. A tenant's
budget holds a request back for its refill (`budget_wait`), a wait it knows exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvgate.core.admission import AdmissionPolicy
from kvgate.core.flow.queue import Waiter, WaitQueue
from kvgate.core.request import AdmissionRequest, Priority
from kvgate.core.tenants import TenantRefusal

if TYPE_CHECKING:
    from kvgate.core.flow.controller import FlowController


class Ahead(NamedTuple):
    """The waiters an arrival would be served after."""

    tokens: int  # their costs (prompt + max_tokens): 0 when none waits ahead
    expected: float  # their expected footprints (learned output lengths, shared prompts once)
    informed: bool  # every one of those lengths is learned, none a guess


class Wait(NamedTuple):
    """A predicted wait: `seconds` at the nodes' recent pace (the likely one, a refusal's
    Retry-After), `soonest` at their fastest healthy pace, and whether it rests on
    measurements alone (a request is never refused on a prior)."""

    seconds: float
    soonest: float
    measured: bool


def ahead(queue: WaitQueue, policy: AdmissionPolicy, request: AdmissionRequest) -> Ahead:
    """The waiters that would be served before `request`: every more important band, and
    its own band as its tenant's fair share would order it."""
    priority = request.priority
    tokens = 0
    expected = 0.0
    informed = True
    for band in Priority:
        if band >= priority:
            break
        if queue.band_count(band):
            tokens += queue.band_tokens(band)
            band_expected, band_informed = _expected(queue, policy, band, request)
            expected += band_expected
            informed = informed and band_informed
    same = queue.band_tokens(priority)
    if same:
        share = 1.0
        if queue.fairness.name != "fcfs":
            own = queue.tenant_count(priority, request.tenant)
            tenants = max(1, queue.backlogged_tenants(priority))
            count = max(1, queue.band_count(priority))
            share = min(1.0, (own + 1) * tenants / count)
        band_expected, band_informed = _expected(queue, policy, priority, request)
        tokens += int(same * share)
        expected += band_expected * share
        informed = informed and band_informed
    return Ahead(tokens, expected, informed)


def shared(policy: AdmissionPolicy, request: AdmissionRequest) -> int:
    """The most prompt tokens of `request` one of its candidates holds already (running
    requests' shared prefix blocks, `kvgate.core.prefix.held`): there it costs that less."""
    ids = request.prompt_ids
    if not ids:
        return 0
    return max((policy.sharing.on(node, ids) for node in request.candidates), default=0)


def predict(policy: AdmissionPolicy, request: AdmissionRequest, waiting: Ahead) -> Wait | None:
    """When the request could start (see `Wait`), or None when nothing predicts that it
    ever could (no candidate could hold it even once all that runs has ended)."""
    estimate = policy.start_estimate(request)
    if estimate is None:
        return None
    wait = Wait(estimate.seconds, estimate.soonest_s, estimate.measured)
    if not waiting.tokens:
        return wait
    cost = request.cost
    expected = policy.lengths.expected(request.model, cost.max_output_tokens, request.exact_output)
    needed = waiting.expected + policy.footprint(request, expected) - shared(policy, request)
    drain = policy.drain_time(needed, request.candidates)
    if drain is None:
        # Nothing runs that could free room for those ahead (they wait for a sync, a late
        # node, their tenants): when is not known.
        return wait._replace(measured=False)
    measured = wait.measured and waiting.informed and policy.measured(request)
    # The soonest judges a refusal, which only a measured prediction makes.
    soonest = policy.drain_time(needed, request.candidates, fastest=True) if measured else None
    soonest = drain if soonest is None else min(soonest, drain)
    return Wait(max(wait.seconds, drain), max(wait.soonest, soonest), measured)


def _expected(
    queue: WaitQueue, policy: AdmissionPolicy, band: Priority, request: AdmissionRequest
) -> tuple[float, bool]:
    """A band's waiters at their expected footprints, and whether every one of those
    lengths is informed (see the module docstring)."""
    lengths = policy.lengths
    overhead = policy.footprint(request, 0) - request.cost.prompt_tokens
    tokens = float(queue.band_tokens(band) - queue.band_shared(band))
    tokens += overhead * queue.band_count(band)
    informed = True
    for model, outputs in queue.outputs(band).items():
        quantile = lengths.learned(model).quantile
        if quantile is not None:
            tokens -= outputs.total - min(outputs.total, outputs.count * max(1, quantile))
        informed = informed and lengths.informed(model, outputs.largest)
    return tokens, informed


def budget_wait(
    flow: FlowController, request: AdmissionRequest, now: float, waiter: Waiter | None = None
) -> float:
    """Seconds its tenant's budgets keep the request from starting (0: they do not), in
    line behind the tenant's waiters (those before `waiter`, or all of them): the refill,
    or the time its node needs if longer. The queue ahead is not drained first: it is
    mostly the tenant's own waiters, held by the same budget (the refill counts them
    already)."""
    tenant = request.tenant
    count, tokens = flow.queue.tenant_waiting(tenant, before=waiter)
    if not count and flow.budgets.blocked(tenant, request.cost, now) is None:
        return 0.0
    since = None if waiter is None else waiter.enqueued_at
    refill = flow.budgets.wait(tenant, request.cost, (tokens, count), now, since)
    if not refill:
        return 0.0
    estimate = flow.policy.start_estimate(request)
    return refill if estimate is None else max(refill, estimate.seconds)


def tenant_wait(
    flow: FlowController, request: AdmissionRequest, blocked: TenantRefusal, now: float
) -> float | None:
    """Seconds until the tenant's own running requests have freed what this one needs:
    from when each is expected to end, else from the rate the tenant has been freeing."""
    tickets = flow.by_tenant.get(request.tenant)
    if tickets:
        ends = sorted((flow.policy.time_left(t), t.request.cost.total) for t in tickets.values())
        if blocked.limit == "requests":
            return ends[0][0]
        needed = blocked.held + blocked.requested - blocked.maximum
        for at, tokens in ends:
            needed -= tokens
            if needed <= 0:
                return at
    return flow.tenants.wait_estimate(request.tenant, request.cost.total, now)
