"""The flow controller: start a request now, let it wait for room, or refuse it.

The shell (and the simulator) hand every request to `submit()` and get one of three answers:

- `Admit`: it starts now on the ticket's node;
- `Reject`: 429 (no room within the request's bound), 503 (no backend can take it), or 400
  (it can never be served as sent), each with its Retry-After;
- a `Waiter`: it waits in the gateway, not in an engine's KV cache. The caller sets
  `waiter.notify` and waits; the controller calls it exactly once with an `Admit` or a
  `Reject`. The caller gives up on its own at `waiter.deadline` with `expire()` (a 429 whose
  Retry-After is the predicted remaining wait) or when its client leaves with `cancel()`.

**Waiting is a prediction, not a hope** (`kvgate.core.flow.waits`). A request is queued
unless the placement policy predicts it cannot start within its bound (`queue.max_wait_s`
for its priority, lowered by the client's `X-Kvgate-Max-Wait-Ms` and by its tenant's
learned patience, so that its answer ends before its client leaves: `patience`): from the nodes'
envelopes (when their running requests end, at each node's measured step time) and the
waiters ahead of it, each at its expected footprint (its learned output length, not its
`max_tokens`), with what runs ending at its likely length. It is refused at once only when
no node could ever hold it next to what it cannot see draining, or when even the optimistic
prediction misses the bound; the 429's Retry-After is the likely one. Clients are not held
for a bound that was never going to be met, and never refused for one that might: a
prediction that rests on a prior (a pace nothing measured yet, output lengths not learned
yet: a fresh gateway, a new model) queues the request, and a waiter is refused once its
measured prediction passes its deadline, or the deadline itself passes.

**Order** (`queue.WaitQueue`): priority bands (critical, standard, sheddable), then fairness
between tenants (`fairness.TokenFairness`, VTC's token counters), then arrival order.

**Wake-ups.** Whenever room may have appeared (a request ended, a sample arrived, a node
joined) `dispatch()` walks the waiters in order and starts every one that fits. The first
waiter that does not fit promises the node where it would start soonest, from the time it
would start there: later waiters may still start on that node, but only if they are
expected to end by then (backfill that never delays the head). Room therefore accumulates
for a large request whose turn has come, while small ones fill the gap before it. A walk
stops after `MAX_MISSES` waiters in a row that did not fit, so a long queue costs a bounded
amount per wake-up. A waiter whose prompt gets a better count (`recost`) keeps its place
with its new cost, and the walk runs again.

**Bounds.** `queue.max_waiting` and `queue.max_waiting_tokens` cap the waiters per priority
and in total; when a band is full, an arrival of a more important band takes the place of
the newest waiter of the least important band (that one gets its 429), otherwise the
arrival is refused.

**Tenants.** Each tenant's in-flight limits (`TenantLedger`) are checked when a request is
about to start: a tenant at its limit has its requests wait for one of its own to end (the
Retry-After of its refusals comes from the rate at which that tenant frees room), and a
request larger than its tenant's whole limit is refused at once.

**Budgets.** A tenant's budgets (`kvgate.core.budgets`: tokens per minute and per day,
requests per minute) are checked at the same moment: a request that does not fit waits,
behind its tenant's earlier waiters, if the refill comes within its bound, else it gets a
429 `tenant_budget` whose Retry-After is the refill time (barely jittered, and not capped
at `MAX_RETRY_AFTER_S`: a day's budget may take hours); a request larger than a whole
window is refused with a 400. A request reserves its most when it starts and is settled
with what it used when it ends (`release(..., used_tokens=)`).

**Books.** A waiter holds nothing on any node. Admission takes the tenant's lease, its
budgets' reservation and the policy's hold together; `release()` returns them, exactly once.

**Replicas.** The sync task's calls (`local_view`, `set_peer_views`, `set_isolated`) go to
the controller's `ReplicaExchange` (`kvgate.core.replicas.exchange`), which keeps this
replica within its claims on every node's room and every tenant's limits. The policy is
asked through `AdmissionPolicy` (`kvgate.core.admission`) alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvgate.core.admission import (
    AdmissionPolicy,
    Admit,
    Decision,
    Outcome,
    PlannedPeak,
    Reject,
    Ticket,
)
from kvgate.core.budgets import Budgets, Reservation
from kvgate.core.flow import waits
from kvgate.core.flow.fairness import Fairness, TokenFairness
from kvgate.core.flow.patience import Patience
from kvgate.core.flow.queue import Waiter, WaitQueue, WaitState
from kvgate.core.flow.waits import Ahead, Wait
from kvgate.core.replicas.exchange import ReplicaExchange
from kvgate.core.replicas.view import PeerView
from kvgate.core.request import AdmissionRequest, Priority
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, jittered
from kvgate.core.settings import QueueSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import Lease, TenantLedger, TenantRefusal

# A dispatch walk stops after this many waiters in a row found no room.
MAX_MISSES = 16
# A sample wakes the waiters at most this often (a release always does): samples of many
# nodes arrive hundreds of times a second, and each walk costs a scan of the candidates.
SAMPLE_WALK_S = 0.01
# Retry-After when nothing predicts a wait (no rate measured, nothing running to end).
DEFAULT_RETRY_S = 2.0
# A budget's refusal comes back after its refill time, late by at most this fraction (so
# that refused clients do not all return at one instant), and never sooner than this.
BUDGET_JITTER = 0.05
MIN_BUDGET_RETRY_S = 0.01


class FlowController:
    """The admission object the shell holds: queue, fairness and tenants around a policy."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        queue: QueueSettings | None = None,
        *,
        tenants: TenantLedger | None = None,
        budgets: Budgets | None = None,
        fairness: Fairness | None = None,
        strict: bool = False,
        replica: str = "local",
    ) -> None:
        """`strict`: nothing passes a waiter that does not fit (plain FCFS: no backfill,
        no promises), for comparison."""
        self.policy = policy
        self.clock = policy.clock
        self.queue_settings = queue if queue is not None else QueueSettings()
        self.queue = WaitQueue(fairness if fairness is not None else TokenFairness())
        self.tenants = tenants if tenants is not None else TenantLedger()
        self.budgets = budgets if budgets is not None else Budgets()
        # Its name among the gateway's replicas (`exchange.replica`), its view and the others'.
        self.exchange = ReplicaExchange(policy, self.queue, self.tenants, replica, self.budgets)
        self._leases: dict[str, Lease] = {}
        self._reservations: dict[str, Reservation] = {}
        self.by_tenant: dict[str, dict[str, Ticket]] = {}  # live tickets, for tenant waits
        self._dispatching = False
        self.strict = strict
        # The last walk's promises and (policy generation, time) at its end: an arrival
        # while nothing changed since needs only to be tried itself against them.
        self._promised: dict[str, float] = {}
        self._walked: tuple[int, float] = (-1, float("-inf"))
        self.counts: Counter[str] = Counter()  # queued, admitted_after_wait, refused:<reason>
        self.wait_total_s = 0.0
        self.patience = Patience()  # how long each tenant's clients wait (`patience`)
        # The last refusal whose cause was the plan (its planned peak over the ceiling):
        # when, of which priority, and the plan (for /admin/state and the dashboard).
        self.refused_peak: tuple[float, Priority, PlannedPeak] | None = None

    # --- the three answers ---------------------------------------------------------------------

    def submit(self, request: AdmissionRequest) -> Decision | Waiter:
        blind = self.exchange.refusal()
        if blind is not None:  # a replica that cannot know what the others admit
            return blind
        now = self.clock.now()
        tokens = request.cost.total
        too_big = self.tenants.never_fits(request.tenant, tokens)
        if too_big is not None:
            self.tenants.refused(request.tenant)
            return Reject(400, "tenant_limit", 0.0, f"{too_big.message} It can never start.")
        budgeted = self.budgets.governs(request.tenant)
        if budgeted:
            never = self.budgets.too_big(request.tenant, request.cost)
            if never is not None:
                self.budgets.refused(request.tenant)
                return Reject(400, "tenant_budget", 0.0, never.never_message)
        self.exchange.arrived(now, tokens)
        bound = self._bound(request)
        blocked = self.tenants.check(request.tenant, tokens)
        held = waits.budget_wait(self, request, now) if budgeted else 0.0
        ahead = waits.ahead(self.queue, self.policy, request)
        decision: Decision | None = None
        quiet = self._walked[0] == self.policy.generation  # nothing changed since the walk
        if blocked is None and not held and (not ahead.tokens or quiet):
            # Waiters ahead, nothing changed since the last walk: only this one might start.
            decision = self.policy.admit(request, self._promised if ahead.tokens else None)
            if isinstance(decision, Admit):
                return self._past_deadline(decision.ticket, 0.0) or self._started(
                    decision.ticket, now, 0.0, decision
                )
            if not decision.waitable:
                return decision
        if bound <= 0:
            return self._refusal_now(request, decision, blocked, held, ahead, now)
        # Held back by its tenant's budget: the refill is the wait, measured.
        wait = (
            Wait(held, held, True) if held else self._predicted_wait(request, ahead, blocked, now)
        )
        if wait is None or (wait.measured and wait.soonest > bound):
            return self._refusal_now(request, decision, blocked, held, ahead, now, wait)
        full = self._make_room(request)
        if full is not None:
            return self._refusal("queue_full", full, request, wait.seconds)
        waiter = Waiter(
            request=request,
            enqueued_at=now,
            deadline=now + bound,
            seq=self.queue.next_seq(),
            tokens=tokens,
            shared=waits.shared(self.policy, request),
        )
        self.queue.push(waiter)
        if ahead.tokens and not quiet:
            self.dispatch()
        if waiter.decision is not None:
            return waiter.decision
        self.counts["queued"] += 1
        return waiter

    def cancel(self, waiter: Waiter) -> None:
        """The client left while waiting: drop it (it holds nothing)."""
        if waiter.waiting:
            now = self.clock.now()
            self.patience.left(waiter.request.tenant, now - waiter.enqueued_at, now)
            self.queue.remove(waiter, WaitState.CANCELLED)
            self.counts["cancelled"] += 1
            self.dispatch()  # it may have been the head that held a promise

    def expire(self, waiter: Waiter) -> Decision:
        """The waiter's deadline passed: refuse it (or return what was decided meanwhile)."""
        if waiter.decision is not None:
            return waiter.decision
        now = self.clock.now()
        request = waiter.request
        blocked = self.tenants.check(request.tenant, waiter.tokens)
        ahead = waits.ahead(self.queue, self.policy, request)
        wait = self._predicted_wait(request, ahead, blocked, now)
        message = _TIMEOUT_MESSAGE.format(waited=now - waiter.enqueued_at)
        held = 0.0
        if blocked is None and self.budgets.governs(request.tenant):
            held = waits.budget_wait(self, request, now, waiter)
        if held:
            decision = self._budget_refusal(request, message, held)
        else:
            reason = "tenant_limit" if blocked is not None else "queue_timeout"
            seconds = None if wait is None else wait.seconds
            decision = self._refusal(reason, message, request, seconds)
        self._decide(waiter, decision, WaitState.REFUSED)
        return decision

    def recost(self, changes: Sequence[tuple[Waiter | Ticket, AdmissionRequest]]) -> None:
        """Requests get new costs (a better count of their prompts arrived): each copy
        replaces its waiter's request, which keeps its place in the queue, or a started
        request's (`AdmissionPolicy.recount`); then the waiters are walked, since a smaller
        cost may start now. Waiters that left are skipped."""
        changed = False
        for entry, request in changes:
            if isinstance(entry, Ticket):
                self.policy.recount(entry, request)
                changed = True
            elif entry.waiting:
                self.queue.update(entry, request)
                changed = True
        if changed:
            self._walked = (-1, self._walked[1])  # the last walk's promises used old costs
            self.dispatch()

    # --- wake-ups -------------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Start every waiter that fits now, in order, respecting the heads' promises."""
        if not self.queue.count or self._dispatching:
            return
        self._dispatching = True
        try:
            self._walk(self.clock.now())
        finally:
            self._dispatching = False

    def _walk(self, now: float) -> None:
        promised: dict[str, float] = {}
        # Sizes that found no room in this walk, by kind of request: a waiter at least as
        # large in prompt and output (same priority, model and candidates) cannot find any
        # either, since promises only accumulate and every start only adds load.
        failed: dict[tuple[object, ...], list[tuple[int, int]]] = {}
        misses = 0
        policy = self.policy
        budgets = self.budgets
        held: set[str] = set()  # tenants whose budget holds back a waiter in this walk
        for waiter in self.queue.order():
            request = waiter.request
            if now >= waiter.deadline:
                self.expire(waiter)
                continue
            tenant = request.tenant
            if self.tenants.check(tenant, waiter.tokens) is not None:
                continue  # waits for one of its own tenant's requests to end
            if tenant in held or (
                budgets.governs(tenant) and budgets.blocked(tenant, request.cost, now)
            ):
                held.add(tenant)  # its tenant's later waiters wait behind it
                continue
            kind = (request.priority, request.model, request.exact_output, request.candidates)
            cost = request.cost
            prompt, output = cost.prompt_tokens, cost.max_output_tokens
            if any(p <= prompt and o <= output for p, o in failed.get(kind, ())):
                misses += 1
                if self.strict or misses >= MAX_MISSES:
                    break
                continue
            decision = policy.admit(request, promised)
            if isinstance(decision, Admit):
                waited = now - waiter.enqueued_at
                late = self._past_deadline(decision.ticket, waited)
                if late is not None:
                    self._decide(waiter, late, WaitState.REFUSED)
                    continue
                self._decide(waiter, self._started(decision.ticket, now, waited, decision),
                             WaitState.ADMITTED)  # fmt: skip
                misses = 0
                continue
            if not decision.waitable:
                self._decide(waiter, decision, WaitState.REFUSED)
                continue
            misses += 1
            failed.setdefault(kind, []).append((prompt, output))
            if self.strict:
                break
            estimate = policy.start_estimate(request)
            if estimate is not None:
                if estimate.measured and now + estimate.soonest_s > waiter.deadline:
                    refusal = self._refusal(
                        "wait_exceeded", _EXCEEDED_MESSAGE, request, estimate.seconds
                    )
                    self._decide(waiter, refusal, WaitState.REFUSED)
                    continue
                promised.setdefault(estimate.node_id, now + estimate.seconds)
            if misses >= MAX_MISSES:
                break
        self._promised = promised
        self._walked = (policy.generation, now)

    # --- the admitted request's life -------------------------------------------------------------

    def on_first_token(self, ticket: Ticket) -> None:
        self.policy.on_first_token(ticket)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        self.policy.on_tokens(ticket, output_tokens)

    def release(self, ticket: Ticket, outcome: Outcome, used_tokens: int | None = None) -> None:
        """Give back the ticket's hold and its tenant's lease, and settle its budgets with
        `used_tokens` (prompt + output as the engine counted them; 0 when the request never
        reached an engine; None: its prompt and the output tokens reported); idempotent."""
        if ticket.released:
            return
        try:
            self.policy.release(ticket, outcome)
        finally:
            lease = self._leases.pop(ticket.key, None)
            if lease is not None:
                self.tenants.release(lease, self.clock.now())
            reservation = self._reservations.pop(ticket.key, None)
            if reservation is not None:
                if used_tokens is None:
                    used_tokens = ticket.request.cost.prompt_tokens + ticket.output_tokens
                self.budgets.settle(reservation, used_tokens, self.clock.now())
            own = self.by_tenant.get(ticket.request.tenant)
            if own is not None:
                own.pop(ticket.key, None)
                if not own:
                    del self.by_tenant[ticket.request.tenant]
            if outcome is Outcome.DONE:
                delta = ticket.output_tokens - ticket.expected_output
                self.queue.fairness.correct(ticket.request.tenant, delta)
            self.patience.ended(ticket, outcome, self.clock.now())
        self.dispatch()

    def observe(self, node_id: str, sample: NodeSample) -> None:
        self.policy.observe(node_id, sample)
        if self.clock.now() - self._walked[1] >= SAMPLE_WALK_S:
            self.dispatch()

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        self.policy.observe_failure(node_id, hard)
        self.dispatch()  # a node no longer late: its waiters get their answer now

    def add_node(self, node_id: str) -> None:
        self.policy.add_node(node_id)
        self.dispatch()

    def remove_node(self, node_id: str) -> None:
        self.policy.remove_node(node_id)

    # --- replicas (kvgate.core.replicas.exchange) ---------------------------------------------

    def local_view(self) -> PeerView:
        """What this replica publishes now (`ReplicaExchange.local_view`); publishing it
        commits this replica to its claims: call it once per exchange."""
        return self.exchange.local_view(self.clock.now())

    def set_peer_views(self, views: Sequence[PeerView], members: int) -> None:
        """The other live replicas' latest views (`members` counts this one too)."""
        self.exchange.set_peer_views(views, members, self.clock.now())
        self.dispatch()

    def set_isolated(self, members: int) -> None:
        """The other replicas cannot be seen: keep to a static `1/members` part of every
        node's room and every tenant's limits until `set_peer_views` is called again
        (`members` 0: how many there are is unknown, admit nothing)."""
        self.exchange.set_isolated(members, self.clock.now())
        self.dispatch()

    # --- state ------------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return self.queue.count

    def snapshot(self) -> dict[str, Any]:
        snap = self.policy.snapshot()
        snap["queue"] = self.queue_snapshot()
        snap["tenants"] = self.tenants.snapshot()
        snap["budgets"] = self.budgets.snapshot(self.clock.now())
        snap["cluster"] = self.exchange.snapshot()
        snap["refused_peak"] = self._refused_peak_snapshot()
        return snap

    def _refused_peak_snapshot(self) -> dict[str, Any] | None:
        """The last refusal by the plan: how long ago, the priority, the node that came
        closest, its planned peak, the ceiling and the usage its engine reported."""
        if self.refused_peak is None:
            return None
        at, priority, planned = self.refused_peak
        return {
            "age_s": round(self.clock.now() - at, 3),
            "priority": priority.label,
            **planned.as_dict(),
        }

    def queue_snapshot(self) -> dict[str, Any]:
        now = self.clock.now()
        return {
            **self.queue.snapshot(now),
            "counters": dict(self.counts),
            "wait_total_s": self.wait_total_s,
            "patience": self.patience.snapshot(now),
        }

    # --- helpers ---------------------------------------------------------------------------------

    def _bound(self, request: AdmissionRequest) -> float:
        """Its priority's `max_wait_s`, lowered by the client's own bound and deadline
        (`kvgate.core.flow.patience`)."""
        bound = self.queue_settings.wait_for(request.priority)
        if request.max_wait_s is not None:
            bound = min(bound, max(0.0, request.max_wait_s))
        if bound > 0 and self.patience.bounds(request, self.clock.now()):
            expected = self.policy.lengths.expected(
                request.model, request.cost.max_output_tokens, request.exact_output
            )
            patience = self.patience.bound(request, expected, self.clock.now())
            bound = bound if patience is None else min(bound, patience)
        return bound

    def _predicted_wait(
        self,
        request: AdmissionRequest,
        ahead: Ahead,
        blocked: TenantRefusal | None,
        now: float,
    ) -> Wait | None:
        """When the request could start (`waits.predict`), its tenant's wait included."""
        wait = waits.predict(self.policy, request, ahead)
        if wait is None or blocked is None:
            return wait
        tenant_wait = waits.tenant_wait(self, request, blocked, now)
        if tenant_wait is None:
            return None
        return Wait(max(wait.seconds, tenant_wait), max(wait.soonest, tenant_wait), wait.measured)

    def _refusal_now(
        self,
        request: AdmissionRequest,
        decision: Decision | None,
        blocked: TenantRefusal | None,
        held: float,
        ahead: Ahead,
        now: float,
        wait: Wait | None = None,
    ) -> Reject:
        """The 429 for a request that may not wait (bound 0, or its wait will not fit);
        `held`: the seconds its tenant's budget keeps it back."""
        if wait is None:
            wait = self._predicted_wait(request, ahead, blocked, now)
        seconds = None if wait is None else wait.seconds
        if blocked is not None:
            self.tenants.refused(request.tenant)
            return self._refusal("tenant_limit", blocked.message, request, seconds)
        if held:
            over = self.budgets.blocked(request.tenant, request.cost, now)
            message = _BEHIND_MESSAGE if over is None else over.message
            return self._budget_refusal(request, message, held)
        if isinstance(decision, Reject):
            if decision.planned is not None:
                self.refused_peak = (now, request.priority, decision.planned)
            return self._refusal(
                decision.reason, decision.message, request, seconds, decision.planned
            )
        return self._refusal("wait_exceeded", _EXCEEDED_MESSAGE, request, seconds)

    def _refusal(
        self,
        reason: str,
        message: str,
        request: AdmissionRequest,
        wait: float | None,
        planned: PlannedPeak | None = None,
    ) -> Reject:
        """A 429 whose Retry-After is the predicted wait (a drain estimate or a small
        default when nothing predicts one), jittered, never the clamp by default."""
        if wait is None:
            short = self.policy.shortfall(request)
            wait = self.policy.drain_time(short, request.candidates)
        centre = DEFAULT_RETRY_S if wait is None else wait
        top = MAX_RETRY_AFTER_S
        centre = min(max(MIN_RETRY_AFTER_S, centre), top)
        self.counts[f"refused:{reason}"] += 1
        delay = jittered(centre, self.policy.rng, top)
        return Reject(429, reason, delay, message, planned=planned)

    def _budget_refusal(self, request: AdmissionRequest, message: str, wait: float) -> Reject:
        """A 429 `tenant_budget` whose Retry-After is the refill time, a little later."""
        self.budgets.refused(request.tenant)
        self.counts["refused:tenant_budget"] += 1
        delay = max(MIN_BUDGET_RETRY_S, wait) * self.policy.rng.uniform(1.0, 1.0 + BUDGET_JITTER)
        return Reject(429, "tenant_budget", delay, message)

    def _make_room(self, request: AdmissionRequest) -> str | None:
        """None when the request may join the queue (after evicting a less important waiter
        if its band is full); else why it may not."""
        caps = self.queue_settings
        queue = self.queue
        band = request.priority
        tokens = request.cost.total
        while True:
            checks = (
                (caps.cap(caps.max_waiting, band.label), queue.band_count(band) + 1),
                (caps.cap(caps.max_waiting, "total"), queue.count + 1),
                (caps.cap(caps.max_waiting_tokens, band.label), queue.band_tokens(band) + tokens),
                (caps.cap(caps.max_waiting_tokens, "total"), queue.tokens + tokens),
            )
            if all(cap is None or would <= cap for cap, would in checks):
                return None
            victim = queue.newest(below=band)
            if victim is None:
                return _FULL_MESSAGE
            estimate = self.policy.start_estimate(victim.request)
            wait = None if estimate is None else estimate.seconds
            refusal = self._refusal("queue_full", _EVICTED_MESSAGE, victim.request, wait)
            self._decide(victim, refusal, WaitState.REFUSED)

    def _past_deadline(self, ticket: Ticket, waited: float) -> Reject | None:
        """The 429 of a request that could start, but whose answer would end after its
        client's deadline (`Patience.late`): its hold is given back at once."""
        deadline = self.patience.answer_deadline(ticket.request, self.clock.now())
        if deadline is None:  # most requests: no time_left asked
            return None
        late = self.patience.late(ticket, waited, self.policy.time_left(ticket, True), deadline)
        if late is None:
            return None
        self.policy.release(ticket, Outcome.CLIENT_CANCEL)
        return self._refusal("client_deadline", late, ticket.request, None)

    def _started(self, ticket: Ticket, now: float, waited: float, admit: Admit) -> Admit:
        request = ticket.request
        ticket.waited_s = waited
        lease = self.tenants.acquire(request.tenant, request.cost.total)
        if isinstance(lease, Lease):
            self._leases[ticket.key] = lease
        reservation = self.budgets.reserve(request.tenant, request.cost, now)
        if reservation is not None:
            self._reservations[ticket.key] = reservation
        self.by_tenant.setdefault(request.tenant, {})[ticket.key] = ticket
        self.queue.fairness.charge(
            request.tenant, request.cost.prompt_tokens, ticket.expected_output
        )
        if waited > 0:
            self.counts["admitted_after_wait"] += 1
            self.wait_total_s += waited
        return admit

    def _decide(self, waiter: Waiter, decision: Decision, state: WaitState) -> None:
        self.queue.remove(waiter, state)
        waiter.decision = decision
        notify = waiter.notify
        if notify is not None:
            notify(decision)


_EXCEEDED_MESSAGE = (
    "The backends for this model cannot start this request within its wait bound; retry later."
)
_TIMEOUT_MESSAGE = "The request waited {waited:.1f} s without room to start; retry later."
_FULL_MESSAGE = "The gateway's queue is full; retry later."
_BEHIND_MESSAGE = (
    "The tenant's budget cannot start this request and those of the tenant waiting before"
    " it within its wait bound; retry after the refill."
)
_EVICTED_MESSAGE = "The request was dropped from a full queue for more important work; retry later."
