"""What every policy shares: node states, tickets, reservations, exact release, snapshot.

Reservation accounting (the part that keeps a burst from overrunning a node)
----------------------------------------------------------------------------
A request's KV footprint grows from its prompt (after prefill) to prompt + output, at most
`cost.total` (+ `reservation_overhead_tokens` for block rounding): that full amount is
reserved on its node at admission, before any byte goes upstream. A sample tells us the
engine's *used* KV tokens; it already contains a request's footprint once the request has
been prefilled before the sample was taken. So for each live ticket on a node we keep

    reflected   = 0                                  until a sample taken at least
                                                     `reflect_margin_s` after the
                                                     ticket's first token arrives;
                  est_prompt + output_tokens_known   afterwards (output tokens counted
                                                     only as known by the sample's time)
    unreflected = full_reservation - reflected       (what the sample cannot contain yet)

and the node's predicted usage is

    predicted_tokens = reported_used_tokens + sum(unreflected over live tickets).

After prefill, `unreflected = max_output - output_so_far + overhead`: exactly the growth
still to come, independent of how good the prompt estimate was or of prefix-cache sharing
(shared blocks are already in `reported`). Before the first token we count the whole
estimated cost on top of the sample, which over-counts a prefill in progress; we accept
over-counting (a little lost utilisation for one sample period) and never under-count.
A ticket released before the next sample drops its reservation at once while its blocks
may still be in `reported` until that sample: over-counting again, never under-.

Because a reservation is added at admission and admission checks
`predicted + cost <= ceiling * capacity`, a burst of N requests inside one scrape period
can never push predicted usage past the ceiling (at most the panic watermark), whatever N.

`sampled_at` should be the clock time at which the scrape was *sent*: the engine renders
its page after that instant, so everything we knew at `sampled_at` is in the page. Engine
gauges also lag by about one iteration, and a shell that stamps the time the page *arrived*
adds up to one scrape timeout: `reflect_margin_s` (default 0.1 s) covers both.

Reflection is incremental, with the same result as re-walking every live ticket at every
sample: a ticket's `reflected` can only change when the sample's cutoff passes one of its
three instants (first token, the two token-count points kept), so each hold is queued on
its node under the next such instant (re-queued when `on_first_token`/`on_tokens` change
it) and a sample recomputes only the holds whose instant its cutoff has reached: O(changed
tickets) per sample instead of O(live tickets). Consequently the policy learns of a first
token or a count only through `on_first_token`/`on_tokens` (the contract's way), not from
a ticket's fields written directly.

Limits, said plainly: a request preempted by the engine loses its blocks and is no longer
in `reported` while we count it as reflected; that is under-counting, but preemption only
happens at KV exhaustion, which the thrashing detector turns into "no new requests to this
node". Requests sent with no `max_tokens` are assumed to stop at `default_max_tokens`; the
shell should put that cap into the upstream body, or an engine may exceed the reservation.
Engines without a KV gauge (llama.cpp, TGI): nothing is ever "reflected", so predicted
usage is the sum of the full reservations on that node against the reported or configured
(`default_capacity_tokens`) capacity; with no capacity at all predicted usage is unknown and
such a node is gated by its queue (`waiting > 0` means "full") and thrashing signals.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.clock import Clock
from kvgate.core.nodes import NodeState, next_level
from kvgate.core.rates import DecayingRate
from kvgate.core.request import Priority, RequestCost
from kvgate.core.reservations import InProcessReservationStore, ReservationStore
from kvgate.core.retry_after import jittered, retry_after
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

TICKET_KEY = "kvgate.key"


_NEG_INF = float("-inf")


class _Hold:
    """The policy's private record of one live ticket.

    `cut` is the cutoff at which `reflected` was last recomputed; `wake_at` the instant
    under which the hold is queued for its next recomputation (None: not queued, because
    nothing a later sample can show would change it); `live` is False once released.
    """

    __slots__ = (
        "cut",
        "full",
        "key",
        "live",
        "node_id",
        "reflected",
        "ticket",
        "tok_cur",
        "tok_cur_at",
        "tok_prev",
        "tok_prev_at",
        "wake_at",
    )

    def __init__(self, key: str, ticket: Ticket, node_id: str, full: int) -> None:
        self.key = key
        self.ticket = ticket
        self.node_id = node_id
        self.full = full
        self.reflected = 0
        self.tok_prev = 0
        self.tok_prev_at = _NEG_INF
        self.tok_cur = 0
        self.tok_cur_at = _NEG_INF
        self.cut = _NEG_INF
        self.wake_at: float | None = None
        self.live = True

    def output_known_by(self, cutoff: float) -> int:
        """A lower bound of the output tokens produced by `cutoff` (two recent points kept)."""
        if self.tok_cur_at <= cutoff:
            return self.tok_cur
        if self.tok_prev_at <= cutoff:
            return self.tok_prev
        return 0


class _Wakeups:
    """One node's holds queued under instants: a FIFO for instants that arrive in order
    (the common case: a count taken now) and a heap for the rest. Both O(1)-ish to pop.

    Entries of released or re-queued holds are dropped when popped; a node whose samples
    never pop anything (no KV gauge) is compacted instead, so the queue stays O(live holds).
    """

    __slots__ = ("fifo", "heap")

    def __init__(self) -> None:
        self.fifo: deque[tuple[float, _Hold]] = deque()
        self.heap: list[tuple[float, int, _Hold]] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def compact(self) -> None:
        """Keep only the entries a sample would still act on."""
        self.fifo = deque(e for e in self.fifo if e[1].live and e[1].wake_at == e[0])
        self.heap = [e for e in self.heap if e[2].live and e[2].wake_at == e[0]]
        heapq.heapify(self.heap)


class BasePolicy:
    """Shared machinery; subclasses implement `_decide` (and optionally the hooks)."""

    name = "base"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        store: ReservationStore | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        seed = rng_seed if rng_seed is not None else settings.seed
        self.rng = random.Random(seed)
        self.store: ReservationStore = store if store is not None else InProcessReservationStore()
        self.nodes: dict[str, NodeState] = {}
        self._holds: dict[str, _Hold] = {}
        self._by_node: dict[str, dict[str, _Hold]] = {}
        # Per node: holds queued under an instant - when a sample's cutoff reaches it, the
        # hold's reflection may change (see "Reflection is incremental").
        self._wakeups: dict[str, _Wakeups] = {}
        self._wake_seq = itertools.count()
        self._seq = itertools.count()
        self._in_flight_tokens = 0
        self._full_by_node: dict[str, int] = {}
        self._freed = DecayingRate(settings.release_rate_halflife_s)
        self._rr = 0
        # Bumped whenever anything a decision depends on changes (sample, ticket, node set),
        # so a policy may cache a "nothing fits" scan until the next change.
        self.generation = 0

    # --- the AdmissionPolicy contract ------------------------------------------------------

    def admit(
        self,
        request_id: str,
        cost: RequestCost,
        priority: Priority,
        candidates: Sequence[str],
    ) -> Decision:
        now = self.clock.now()
        if not candidates:
            return self._reject_unavailable(
                "no_backend", "No backend serves this model.", now, retry_s=1.0
            )
        choice = self._decide(now, cost, priority, candidates)
        if isinstance(choice, Reject):
            return choice
        return Admit(self._open(now, request_id, choice, cost, priority))

    def on_first_token(self, ticket: Ticket) -> None:
        if ticket.first_token_at is None:
            ticket.first_token_at = self.clock.now()
        if (node := self.nodes.get(ticket.node_id)) is not None:
            node.progress(ticket.first_token_at)
        hold = self._holds.get(ticket.extra.get(TICKET_KEY, ""))
        if hold is not None:
            self._schedule(hold, ticket.first_token_at)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        now = self.clock.now()
        if (node := self.nodes.get(ticket.node_id)) is not None:
            node.progress(now)
        hold = self._holds.get(ticket.extra.get(TICKET_KEY, ""))
        if ticket.first_token_at is None:
            ticket.first_token_at = now
            if hold is not None:
                self._schedule(hold, now)
        if hold is None or output_tokens <= hold.tok_cur:
            return
        ticket.output_tokens = output_tokens
        hold.tok_prev = hold.tok_cur
        hold.tok_prev_at = hold.tok_cur_at
        hold.tok_cur = output_tokens
        hold.tok_cur_at = now
        self._schedule(hold, now)

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.released:
            return
        ticket.released = True
        hold = self._holds.pop(ticket.extra.get(TICKET_KEY, ""), None)
        if hold is None:
            return
        hold.live = False
        self.store.release(hold.node_id, hold.key)
        on_node = self._by_node.get(hold.node_id)
        if on_node is not None:
            on_node.pop(hold.key, None)
            if not on_node:
                del self._by_node[hold.node_id]
                self._wakeups.pop(hold.node_id, None)  # only dead holds left in it
        self._in_flight_tokens -= hold.full
        self.generation += 1
        left = self._full_by_node.get(hold.node_id, 0) - hold.full
        if left:
            self._full_by_node[hold.node_id] = left
        else:
            self._full_by_node.pop(hold.node_id, None)
        self._refresh_level(hold.node_id)
        now = self.clock.now()
        self._freed.add(now, hold.full)
        self._on_release(now, hold, outcome)

    def observe(self, node_id: str, sample: NodeSample) -> None:
        now = self.clock.now()
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        if not node.accept(sample, now, self.settings):
            return
        self.generation += 1
        self._reflect(node_id, sample)
        self._refresh_level(node_id)
        self._on_observe(now, node)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        node.fail(hard)
        self.generation += 1

    def add_node(self, node_id: str) -> None:
        if node_id not in self.nodes:
            self.nodes[node_id] = NodeState(node_id)
            self.generation += 1

    def remove_node(self, node_id: str) -> None:
        """Forget the node's state; its live tickets stay held until the shell releases them."""
        self.nodes.pop(node_id, None)
        self.generation += 1

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.now()
        return {
            "policy": self.name,
            "time": now,
            "nodes": {nid: self._node_snapshot(now, node) for nid, node in self.nodes.items()},
            "controller": self._controller_snapshot(now),
            "in_flight_requests": len(self._holds),
            "released_tokens_per_s": self._freed.value(now),
        }

    # --- for subclasses ---------------------------------------------------------------------

    def _decide(
        self, now: float, cost: RequestCost, priority: Priority, candidates: Sequence[str]
    ) -> str | Reject:
        raise NotImplementedError

    def _on_observe(self, now: float, node: NodeState) -> None:
        """Called after a new sample was accepted and reflected."""

    def _on_release(self, now: float, hold: _Hold, outcome: Outcome) -> None:
        """Called once per released ticket."""

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        return {
            "budget_tokens": None,
            "in_flight_tokens": self._in_flight_tokens,
            "setpoint": None,
            "shed_probability": {"critical": 0.0, "standard": 0.0, "sheddable": 0.0},
        }

    # --- helpers ------------------------------------------------------------------------------

    @property
    def in_flight_requests(self) -> int:
        return len(self._holds)

    @property
    def in_flight_tokens(self) -> int:
        return self._in_flight_tokens

    def in_flight_on(self, node_id: str) -> int:
        on_node = self._by_node.get(node_id)
        return len(on_node) if on_node else 0

    def full_reserved_on(self, node_id: str) -> int:
        """The full (not only unreflected) reservations of the live tickets on `node_id`."""
        return self._full_by_node.get(node_id, 0)

    def freed_tokens_per_s(self, now: float) -> float:
        return self._freed.value(now)

    def reservation_for(self, cost: RequestCost) -> int:
        return cost.total + self.settings.reservation_overhead_tokens

    def predicted_tokens(self, node: NodeState) -> float | None:
        """Reported used tokens plus what the sample cannot reflect yet; None if unknowable."""
        if node.cap is None:
            return None
        return node.used + self.store.reserved(node.node_id)

    def predicted_usage(self, node: NodeState) -> float | None:
        capacity = node.capacity(self.settings)
        tokens = self.predicted_tokens(node)
        if capacity is None or tokens is None:
            return None
        return tokens / capacity

    def least_loaded(self, candidates: Sequence[str]) -> str:
        """Fewest live tickets; ties broken round-robin so equal nodes share the load.

        From `p2c_min_nodes` candidates on: the less loaded of two random ones (O(1)).
        """
        n = len(candidates)
        if n >= self.settings.p2c_min_nodes:
            i = self.rng.randrange(n)
            j = self.rng.randrange(n - 1)
            a, b = candidates[i], candidates[j + (j >= i)]
            return a if self.in_flight_on(a) <= self.in_flight_on(b) else b
        self._rr = (self._rr + 1) % n
        best = candidates[self._rr]
        best_load = self.in_flight_on(best)
        for i in range(1, n):
            cand = candidates[(self._rr + i) % n]
            load = self.in_flight_on(cand)
            if load < best_load:
                best, best_load = cand, load
        return best

    def reject_shed(self, reason: str, message: str, now: float, excess_tokens: float) -> Reject:
        """429: shed now, come back after the cluster has freed `excess_tokens`."""
        delay = retry_after(
            excess_tokens, self._freed.value(now), self.settings.retry_after_max_s, self.rng
        )
        return Reject(status=429, reason=reason, retry_after_s=delay, message=message)

    def _reject_unavailable(
        self, reason: str, message: str, now: float, retry_s: float | None = None
    ) -> Reject:
        """503: no backend can serve at all; retry after about one staleness period."""
        centre = retry_s if retry_s is not None else max(1.0, self.settings.stale_after_s)
        centre = min(max(1.0, centre), self.settings.retry_after_max_s)
        delay = jittered(centre, self.rng, self.settings.retry_after_max_s)
        return Reject(status=503, reason=reason, retry_after_s=delay, message=message)

    def _open(
        self, now: float, request_id: str, node_id: str, cost: RequestCost, priority: Priority
    ) -> Ticket:
        key = f"{next(self._seq)}:{request_id}"
        ticket = Ticket(
            request_id=request_id,
            node_id=node_id,
            cost=cost,
            priority=priority,
            admitted_at=now,
            extra={TICKET_KEY: key},
        )
        full = self.reservation_for(cost)
        hold = _Hold(key, ticket, node_id, full)
        self.store.reserve(node_id, key, full)
        self._holds[key] = hold
        self._by_node.setdefault(node_id, {})[key] = hold
        self._in_flight_tokens += full
        self.generation += 1
        self._full_by_node[node_id] = self._full_by_node.get(node_id, 0) + full
        self._refresh_level(node_id)
        return ticket

    def _reflect(self, node_id: str, sample: NodeSample) -> None:
        """Lower each live ticket's reservation by what this sample already contains.

        For each live ticket whose first token came at least `reflect_margin_s` before the
        sample: reflected = prompt + output known by then, never lowered, at most the full
        reservation less the overhead. Only the holds queued under an instant this cutoff
        has reached are recomputed; every other hold would come out unchanged.
        """
        queued = self._wakeups.get(node_id)
        if queued is None or sample.kv_usage is None:
            return
        cutoff = sample.sampled_at - self.settings.reflect_margin_s
        overhead = self.settings.reservation_overhead_tokens
        recompute = self._reflect_hold
        fifo, heap = queued.fifo, queued.heap
        popleft = fifo.popleft
        while fifo and fifo[0][0] <= cutoff:
            at, hold = popleft()
            if hold.live and hold.wake_at == at:  # else released, or queued again since
                recompute(node_id, hold, cutoff, overhead)
        while heap and heap[0][0] <= cutoff:
            at, _, hold = heapq.heappop(heap)
            if hold.live and hold.wake_at == at:
                recompute(node_id, hold, cutoff, overhead)

    def _reflect_hold(self, node_id: str, hold: _Hold, cutoff: float, overhead: int) -> None:
        """The walk's formula for one hold at one cutoff; re-queue it unless settled."""
        hold.wake_at = None
        ticket = hold.ticket
        first = ticket.first_token_at
        if first is not None and first <= cutoff:
            if hold.tok_cur_at <= cutoff:
                known = hold.tok_cur
            elif hold.tok_prev_at <= cutoff:
                known = hold.tok_prev
            else:
                known = 0
            reflected = ticket.cost.prompt_tokens + known
            if reflected < hold.reflected:
                reflected = hold.reflected
            most = hold.full - overhead
            if reflected > most:
                reflected = most
            if reflected != hold.reflected:
                hold.reflected = reflected
                self.store.update(node_id, hold.key, hold.full - reflected)
        hold.cut = cutoff
        if first is None or first > cutoff or hold.tok_cur_at > cutoff:
            self._schedule(hold)  # else settled: every instant is at or before the cutoff

    def _schedule(self, hold: _Hold, touched_at: float | None = None) -> None:
        """Queue `hold` under the next instant at which a sample could change its reflection.

        From its last recomputation's cutoff (`cut`) up to the next of its instants (first
        token, previous and current token-count times) after `cut`, what a sample reflects
        of it is constant, so no sample before that instant needs to look at it; with no
        such instant it is settled. `touched_at` is the instant `on_first_token`/`on_tokens`
        just wrote: if it is not after `cut` (a zero margin, a count taken at the cutoff's
        very time) the next sample looks. A fully reflected hold never changes again.
        """
        if hold.reflected >= hold.full - self.settings.reservation_overhead_tokens:
            return
        first = hold.ticket.first_token_at
        if first is None:
            return  # nothing to reflect before a first token; on_first_token queues it
        cut = hold.cut
        wake: float | None
        if touched_at is not None and touched_at <= cut:
            wake = cut
        else:
            wake = hold.tok_prev_at  # the earliest instant after `cut` (prev_at <= cur_at)
            if wake <= cut:
                wake = hold.tok_cur_at
                if wake <= cut:
                    wake = None
            if first > cut and (wake is None or first < wake):
                wake = first
            if wake is None:
                return  # settled until on_tokens changes it
        queued = hold.wake_at
        if queued is not None and queued <= wake:
            return  # already queued no later than needed; that look re-queues it
        hold.wake_at = wake
        queue = self._wakeups.get(hold.node_id)
        if queue is None:
            queue = self._wakeups[hold.node_id] = _Wakeups()
        fifo = queue.fifo
        if not fifo or fifo[-1][0] <= wake:
            fifo.append((wake, hold))
        else:
            heapq.heappush(queue.heap, (wake, next(self._wake_seq), hold))
        if len(fifo) + len(queue.heap) > 2 * len(self._by_node[hold.node_id]) + 64:
            queue.compact()  # amortised O(1): at least half of it was dead

    def _refresh_level(self, node_id: str) -> None:
        """Move the node's watermark state (with hysteresis) after its usage changed."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        usage = self.predicted_usage(node)
        if usage is None:
            return
        s = self.settings
        node.level = next_level(
            node.level, usage, s.high_watermark, s.panic_watermark, s.hysteresis
        )

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = node.snapshot(now, self.settings)
        entry["reserved_tokens"] = self.store.reserved(node.node_id)
        entry["in_flight"] = self.in_flight_on(node.node_id)
        entry["predicted_usage"] = self.predicted_usage(node)
        return entry
