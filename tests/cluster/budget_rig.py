"""Replicas sharing a tenant's budget in virtual time, and the bucket they must never overspend.

`Rig` runs `n` real flow controllers on one `ManualClock`, each linked to the others by its
real sync task (`ClusterSync`) through the in-process store, each ticking at its own phase
of the 50 ms period. Closed-loop clients send requests of one tenant to their replica; a
request that starts runs for a while and ends with what it used; a refused one comes back
after its Retry-After. Every reservation and settle of every replica is replayed, in time
order, into `Oracle`: the one true bucket of the tenant (what may be reserved, refilled
continuously up to a window, refunds up to a full bucket). The replicas are right if that
bucket never goes below zero. The rig can make the store unreachable, wipe it, kill a
replica (it stops ticking and its requests never end) or start a new one.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.cluster.store import MemoryStore
from kvgate.cluster.sync import SYNC_PERIOD_S, ClusterSync
from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.budgets import BudgetLimits, Budgets, Reservation
from kvgate.core.budgets.bucket import TOKENS_PER_MINUTE
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

TENANT = "t"
SAMPLE_S = 0.05
STEP_S = 0.01  # seconds per output token


class Oracle:
    """The tenant's one true bucket (tokens per minute), fed every replica's books."""

    def __init__(self, capacity: float, start: float) -> None:
        self.capacity = capacity
        self.rate = capacity / TOKENS_PER_MINUTE.seconds
        self.free = capacity
        self.at = start
        self.lowest = capacity
        self.used = 0.0
        self.reserved = 0.0

    def advance(self, now: float) -> None:
        if self.free < self.capacity:
            self.free = min(self.capacity, self.free + self.rate * (now - self.at))
        self.at = now

    def reserve(self, now: float, amount: float) -> None:
        self.advance(now)
        self.free -= amount
        self.reserved += amount
        self.lowest = min(self.lowest, self.free)

    def settle(self, now: float, amount: float, used: float) -> None:
        self.advance(now)
        self.free = min(self.capacity, self.free + amount - used)
        self.reserved -= amount
        self.used += used


@dataclass
class Recorded(Budgets):
    """A replica's budgets that tell the oracle every reservation and settle."""

    oracle: Oracle | None = None

    def reserve(self, tenant: str, cost: RequestCost, now: float) -> Reservation | None:
        reservation = super().reserve(tenant, cost, now)
        if reservation is not None and self.oracle is not None:
            self.oracle.reserve(now, _tokens(reservation))
        return reservation

    def settle(self, reservation: Reservation, used_tokens: float, now: float) -> None:
        if not reservation.settled and self.oracle is not None:
            self.oracle.settle(now, _tokens(reservation), used_tokens)
        super().settle(reservation, used_tokens, now)


def _tokens(reservation: Reservation) -> float:
    return next(a for w, _, a in reservation.amounts if w == TOKENS_PER_MINUTE)


@dataclass
class Replica:
    name: str
    flow: FlowController
    sync: ClusterSync
    phase: float
    alive: bool = True
    running: set[int] = field(default_factory=set)  # ids of its tickets not ended yet


@dataclass
class Refusal:
    at: float
    retry_after_s: float
    real_wait_s: float  # the oracle's refill time for it and what waited before it


class Rig:
    def __init__(
        self,
        n: int,
        limits: BudgetLimits,
        *,
        clients: int = 30,
        sizes: tuple[int, int] = (100, 400),
        max_wait_s: float = 5.0,
        use: float = 1.0,
        seed: int = 1,
    ) -> None:
        self.clock = ManualClock(1000.0)
        self.store = MemoryStore(self.clock)
        self.limits = limits
        assert limits.tokens_per_minute is not None
        self.oracle = Oracle(limits.tokens_per_minute, self.clock.now())
        self.rng = random.Random(seed)
        self.sizes, self.max_wait_s, self.use = sizes, max_wait_s, use
        self.replicas: list[Replica] = []
        self.refusals: list[Refusal] = []
        self.answers: dict[str, int] = {"admitted": 0, "refused": 0}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        for i in range(n):
            self.add_replica(phase=i * SYNC_PERIOD_S / n)
        for c in range(clients):
            self.at(self.clock.now() + self.rng.uniform(0, 1.0), lambda c=c: self.send(c))

    # ---- replicas ---------------------------------------------------------------------------

    def add_replica(self, phase: float) -> Replica:
        name = f"r{len(self.replicas)}"
        policy = build_policy(AdmissionSettings(), self.clock, rng_seed=len(self.replicas))
        budgets = Recorded(limits={TENANT: self.limits}, oracle=self.oracle)
        flow = FlowController(policy, budgets=budgets, replica=name)
        flow.add_node("a")
        sync = ClusterSync(self.store, flow, flow, self.clock, nodes=lambda: ["a"], member_id=name)
        replica = Replica(name, flow, sync, phase)
        self.replicas.append(replica)
        flow.set_isolated(max(1, len(self.replicas)))  # what the sync task does first
        self._sample(replica)
        return replica

    def kill(self, index: int) -> None:
        """SIGKILL: it stops ticking, and its running requests never end."""
        self.replicas[index].alive = False

    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    # ---- the clients ------------------------------------------------------------------------

    def send(self, client: int) -> None:
        replicas = self.alive()
        replica = replicas[client % len(replicas)]
        prompt = self.rng.randint(*self.sizes) // 2
        output = self.rng.randint(*self.sizes) // 2
        request = AdmissionRequest(
            f"q{next(self._ids)}", RequestCost(prompt, output), tenant=TENANT, model="m",
            candidates=("a",), exact_output=True, max_wait_s=self.max_wait_s,
        )  # fmt: skip
        ahead = self._waiting_tokens()
        free = self._oracle_free()
        decision = replica.flow.submit(request)
        if isinstance(decision, Waiter):
            waiter = decision
            waiter.notify = lambda d: self._waited(client, replica, waiter, d)
            self.at(waiter.deadline, lambda: self._expire(replica, waiter))
        else:
            self._decided(client, replica, request, decision, ahead, free)

    def _waited(self, client: int, replica: Replica, waiter: Waiter, decision: Decision) -> None:
        """A waiter's answer, judged against what was waiting before it then."""
        ahead = self._waiting_tokens(before=waiter.enqueued_at)
        self._decided(client, replica, waiter.request, decision, ahead, self._oracle_free())

    def _expire(self, replica: Replica, waiter: Waiter) -> None:
        if waiter.waiting and replica.alive:
            replica.flow.expire(waiter)  # its answer comes through `notify`

    def _decided(
        self,
        client: int,
        replica: Replica,
        request: AdmissionRequest,
        decision: Decision,
        ahead: float,
        free: float,
    ) -> None:
        now = self.clock.now()
        if isinstance(decision, Admit):
            self.answers["admitted"] += 1
            ticket = decision.ticket
            key = next(self._ids)
            replica.running.add(key)
            output = request.cost.max_output_tokens
            self.at(now + output * STEP_S, lambda: self._end(client, replica, ticket, key))
            return
        assert isinstance(decision, Reject) and decision.status == 429, decision
        self.answers["refused"] += 1
        if decision.reason == "tenant_budget":  # (not a node's room claimed by the others)
            real = max(0.0, ahead + request.cost.total - free) / self.oracle.rate
            self.refusals.append(Refusal(now, decision.retry_after_s, real))
        self.at(now + decision.retry_after_s, lambda: self.send(client))

    def _end(self, client: int, replica: Replica, ticket: Ticket, key: int) -> None:
        if not replica.alive:
            return
        replica.running.discard(key)
        cost = ticket.request.cost
        used = cost.prompt_tokens + round(cost.max_output_tokens * self.use)
        ticket.output_tokens = used - cost.prompt_tokens
        replica.flow.release(ticket, Outcome.DONE, used_tokens=used)
        self.at(self.clock.now() + self.rng.uniform(0.0, 0.2), lambda: self.send(client))

    def _waiting_tokens(self, before: float = float("inf")) -> float:
        """Tokens of the tenant waiting at every replica (those that came before `before`)."""
        return float(
            sum(
                w.tokens
                for r in self.alive()
                for w in r.flow.queue.waiting()
                if w.request.tenant == TENANT and w.enqueued_at < before
            )
        )

    def _oracle_free(self) -> float:
        self.oracle.advance(self.clock.now())
        return self.oracle.free

    # ---- time ---------------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    async def run(self, seconds: float, *, store_up: bool = True) -> None:
        """Run `seconds` of virtual time: every live replica ticks at its phase, every
        engine sample wakes the waiters, the clients come and go."""
        end = self.clock.now() + seconds
        start = self.clock.now()
        period = int(start / SYNC_PERIOD_S) + 1
        while True:
            tick = period * SYNC_PERIOD_S
            next_event = self._events[0][0] if self._events else float("inf")
            when = min(tick, next_event)
            if when > end:
                break
            self.clock.advance(max(0.0, when - self.clock.now()))
            if next_event <= tick:
                heapq.heappop(self._events)[2]()
                continue
            period += 1
            for replica in self.alive():
                self.at(tick + replica.phase, lambda r=replica: self._tick(r))
            for replica in self.alive():
                self._sample(replica)
        self.clock.advance(max(0.0, end - self.clock.now()))

    def _tick(self, replica: Replica) -> None:
        if not replica.alive:
            return
        sync = replica.sync
        try:
            reply = self.store.exchange_now(sync.member_id, sync.outgoing(), 2.0)
        except Exception as exc:  # the store is unreachable
            sync.failed(str(exc))
            return
        now = self.clock.now()
        sync.incoming(reply, now, now)

    def _sample(self, replica: Replica) -> None:
        sample = NodeSample(0.0, 10_000_000, 0, 0, STEP_S, self.clock.now())
        replica.flow.observe("a", sample)
        replica.flow.dispatch()
