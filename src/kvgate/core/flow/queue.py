"""The waiting room: priority bands, then fairness between tenants, then FIFO.

A `Waiter` is one request that could not start at once and may wait for room. The queue
keeps, per band (critical, standard, sheddable), one FIFO per tenant, and yields waiters in
dispatch order: the most important band first; within it, the tenant the fairness policy
puts first (`fairness.key`, ties to the earlier arrival); within the tenant, arrival order.
Removal is lazy: a waiter that leaves (admitted, refused, cancelled) is marked and skipped,
while the counts and token sums are kept exact at once. Each band also sums, per model, the
output caps of its waiters whose length is to be predicted (`outputs`), so that the flow
controller can count the waiters ahead of an arrival at their expected footprint.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvgate.core.admission import Decision
from kvgate.core.flow.fairness import Fairness
from kvgate.core.request import AdmissionRequest, Priority


class WaitState(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    REFUSED = "refused"
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class Waiter:
    """A request waiting for room. `notify` is set by whoever waits on it (the shell, the
    simulator) and called once with the decision, from inside the core's call that made it.
    """

    request: AdmissionRequest
    enqueued_at: float
    deadline: float
    seq: int
    tokens: int
    shared: int = 0  # prompt tokens its best node held already when queued (counted once)
    state: WaitState = WaitState.WAITING
    decision: Decision | None = None
    notify: Callable[[Decision], None] | None = field(default=None, repr=False)

    @property
    def waiting(self) -> bool:
        return self.state is WaitState.WAITING


class Outputs:
    """One band's waiters of one model whose output length is predicted (not exact)."""

    __slots__ = ("count", "largest", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0  # their output caps (`max_output_tokens`) summed
        self.largest = 0  # the largest of those caps (until the model has no waiter left)


class _Band:
    __slots__ = ("count", "live", "outputs", "shared", "tenants", "tokens")

    def __init__(self) -> None:
        self.tenants: dict[str, deque[Waiter]] = {}  # may hold departed waiters until compacted
        self.live: dict[str, int] = {}  # waiting waiters per tenant
        self.outputs: dict[str, Outputs] = {}  # per model, of the waiters not exact
        self.count = 0
        self.tokens = 0
        self.shared = 0  # the waiters' `shared` summed

    def compact(self) -> None:
        """Drop departed waiters from the front of each FIFO and empty FIFOs."""
        for tenant in list(self.tenants):
            fifo = self.tenants[tenant]
            while fifo and not fifo[0].waiting:
                fifo.popleft()
            if not fifo:
                del self.tenants[tenant]


class WaitQueue:
    """Bands of per-tenant FIFOs; `order()` walks them in dispatch order."""

    def __init__(self, fairness: Fairness) -> None:
        self.fairness = fairness
        self._bands = {p: _Band() for p in Priority}
        self._seq = itertools.count()
        self.count = 0
        self.tokens = 0
        self._tenants: dict[str, list[int]] = {}  # [waiters, tokens] per tenant, every band

    def next_seq(self) -> int:
        return next(self._seq)

    def __len__(self) -> int:
        return self.count

    def band_count(self, priority: Priority) -> int:
        return self._bands[priority].count

    def band_tokens(self, priority: Priority) -> int:
        return self._bands[priority].tokens

    def band_shared(self, priority: Priority) -> int:
        """Prompt tokens of the band's waiters their nodes held already (`Waiter.shared`)."""
        return self._bands[priority].shared

    def tenant_count(self, priority: Priority, tenant: str) -> int:
        return self._bands[priority].live.get(tenant, 0)

    def outputs(self, priority: Priority) -> dict[str, Outputs]:
        """The band's waiters whose length is predicted, per model (see `Outputs`)."""
        return self._bands[priority].outputs

    def tenant_waiting(self, tenant: str, before: Waiter | None = None) -> tuple[int, int]:
        """(waiters, tokens) of `tenant` waiting in every band; with `before`, only those
        it would be dispatched after (more important bands, and earlier in its own)."""
        if before is None:
            count, tokens = self._tenants.get(tenant, (0, 0))
            return count, tokens
        count = tokens = 0
        for waiter in self.waiting():
            if waiter.request.tenant == tenant and waiter is not before:
                ahead = waiter.request.priority, waiter.seq
                if ahead < (before.request.priority, before.seq):
                    count += 1
                    tokens += waiter.tokens
        return count, tokens

    def backlogged_tenants(self, priority: Priority) -> int:
        return sum(1 for n in self._bands[priority].live.values() if n)

    def push(self, waiter: Waiter) -> None:
        band = self._bands[waiter.request.priority]
        tenant = waiter.request.tenant
        fifo = band.tenants.get(tenant)
        if fifo is None:
            fifo = band.tenants[tenant] = deque()
        if not band.live.get(tenant):
            waiting = [t for t, n in band.live.items() if n]
            self.fairness.backlogged(tenant, waiting)
        fifo.append(waiter)
        band.live[tenant] = band.live.get(tenant, 0) + 1
        band.count += 1
        band.tokens += waiter.tokens
        band.shared += waiter.shared
        self.count += 1
        self.tokens += waiter.tokens
        sums = self._tenants.setdefault(tenant, [0, 0])
        sums[0] += 1
        sums[1] += waiter.tokens
        request = waiter.request
        if not request.exact_output:
            outputs = band.outputs.get(request.model)
            if outputs is None:
                outputs = band.outputs[request.model] = Outputs()
            cap = request.cost.max_output_tokens
            outputs.count += 1
            outputs.total += cap
            outputs.largest = max(outputs.largest, cap)

    def remove(self, waiter: Waiter, state: WaitState) -> None:
        """Take a waiting waiter out. It stays in its FIFO, marked, until the next walk
        compacts it away, so removing during a walk never disturbs the walk."""
        if not waiter.waiting:
            return
        waiter.state = state
        band = self._bands[waiter.request.priority]
        tenant = waiter.request.tenant
        left = band.live.get(tenant, 1) - 1
        if left:
            band.live[tenant] = left
        else:
            band.live.pop(tenant, None)
        band.count -= 1
        band.tokens -= waiter.tokens
        band.shared -= waiter.shared
        self.count -= 1
        self.tokens -= waiter.tokens
        sums = self._tenants[tenant]
        sums[0] -= 1
        sums[1] -= waiter.tokens
        if not sums[0]:
            del self._tenants[tenant]
        request = waiter.request
        outputs = band.outputs.get(request.model)
        if not request.exact_output and outputs is not None:
            outputs.count -= 1
            outputs.total -= request.cost.max_output_tokens
            if not outputs.count:
                del band.outputs[request.model]

    def update(self, waiter: Waiter, request: AdmissionRequest) -> None:
        """Give a waiting waiter a new request of the same band and tenant (a new cost),
        keeping its place; the token sums follow its new size."""
        if not waiter.waiting:
            return
        old = waiter.request
        if (request.priority, request.tenant) != (old.priority, old.tenant):
            raise ValueError("a waiter keeps its priority and tenant")
        tokens = request.cost.total
        delta = tokens - waiter.tokens
        waiter.request, waiter.tokens = request, tokens
        band = self._bands[request.priority]
        shared = min(waiter.shared, request.cost.prompt_tokens)
        band.shared += shared - waiter.shared
        waiter.shared = shared
        band.tokens += delta
        self.tokens += delta
        self._tenants[request.tenant][1] += delta

    def order(self) -> Iterator[Waiter]:
        """Waiting waiters in dispatch order. Fairness keys are read at each step, so a
        tenant charged for an admission during the walk moves back at once. Waiters may be
        removed during the walk; none may be pushed."""
        for band in self._bands.values():
            band.compact()
        for priority in Priority:
            band = self._bands[priority]
            if not band.count:
                continue
            cursors = {t: iter(fifo) for t, fifo in band.tenants.items()}
            heads: dict[str, Waiter] = {}
            for tenant, cursor in cursors.items():
                head = _next_waiting(cursor)
                if head is not None:
                    heads[tenant] = head
            key = self.fairness.key
            while heads:
                tenant = min(heads, key=lambda t: (key(t), heads[t].seq))
                waiter = heads[tenant]
                yield waiter
                following = _next_waiting(cursors[tenant])
                if following is None:
                    del heads[tenant]
                else:
                    heads[tenant] = following

    def newest(self, below: Priority) -> Waiter | None:
        """The most recent waiter of the least important band less important than `below`."""
        for priority in reversed(Priority):
            if priority <= below:
                return None
            band = self._bands[priority]
            newest: Waiter | None = None
            for fifo in band.tenants.values():
                for waiter in reversed(fifo):
                    if waiter.waiting:
                        if newest is None or waiter.seq > newest.seq:
                            newest = waiter
                        break
            if newest is not None:
                return newest
        return None

    def snapshot(self, now: float) -> dict[str, Any]:
        """Its waiters per band (count, tokens, the oldest's wait) and per tenant, and its
        fairness."""
        bands: dict[str, dict[str, Any]] = {
            p.label: {"waiting": 0, "tokens": 0, "oldest_s": 0.0} for p in Priority
        }
        tenants: Counter[str] = Counter()
        for waiter in self.waiting():
            band = bands[waiter.request.priority.label]
            band["waiting"] += 1
            band["tokens"] += waiter.tokens
            band["oldest_s"] = max(band["oldest_s"], now - waiter.enqueued_at)
            tenants[waiter.request.tenant] += 1
        return {
            "waiting": self.count,
            "tokens": self.tokens,
            "bands": bands,
            "tenants": dict(tenants),
            "fairness": self.fairness.name,
            "service": self.fairness.snapshot(),
        }

    def waiting(self) -> Iterator[Waiter]:
        for band in self._bands.values():
            for fifo in band.tenants.values():
                yield from (w for w in fifo if w.waiting)


def _next_waiting(cursor: Iterator[Waiter]) -> Waiter | None:
    for waiter in cursor:
        if waiter.waiting:
            return waiter
    return None
