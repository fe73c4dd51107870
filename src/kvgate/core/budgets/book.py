"""Every tenant's budgets on this replica: its buckets, reservations, waits and figures.

`Budgets` keeps, per tenant with a budget, one `Bucket` per configured window (tokens per
minute, tokens per day, requests per minute), made when the tenant's first request comes.
The flow controller (`kvgate.core.flow`) asks it, when a request is about to start, whether
every window has room (`blocked`), how long the refill takes to make some (`wait`), and
takes a `Reservation` (`reserve`) that is settled exactly once when the request ends
(`settle`, a second call is a no-op). A request whose smallest possible size (its prompt
and the output it asked for) is beyond a whole window's budget can never start
(`too_big`). The shell reads `status` for the `x-ratelimit-*` headers and `snapshot` for
`/admin/state` and the metrics; the replica exchange calls `view`, `take` and `isolate`.

Requests without a tenant (a gateway without API keys) have no budget: budgets are the
operator's per-tenant shares, not a cap on the gateway.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kvgate.core.budgets.bucket import WINDOWS, Bucket, BudgetView, PeerEntry, Window
from kvgate.core.request import DEFAULT_TENANT, RequestCost

if TYPE_CHECKING:
    from kvgate.core.replicas.view import PeerView

#: A claim on a bucket's room: `part(tenant, room, whole)` of `room` for this replica
#: (`whole`: in whole requests), as the replica exchange splits it.
Part = Callable[[str, float, bool], float]


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """One tenant's budgets; None: no budget for that window."""

    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    requests_per_minute: int | None = None

    def capacity(self, window: Window) -> int | None:
        value: int | None = getattr(self, window.key)
        return value

    @property
    def any(self) -> bool:
        return any(self.capacity(w) is not None for w in WINDOWS)


NO_BUDGET = BudgetLimits()


@dataclass(slots=True, eq=False)
class Reservation:
    """One request's reservation on its tenant's buckets. Identity makes two distinct."""

    tenant: str
    amounts: list[tuple[Window, Bucket, float]]
    settled: bool = False


@dataclass(frozen=True, slots=True)
class BudgetRefusal:
    """The window that keeps a request from starting: what it needs, of what budget."""

    tenant: str
    window: Window
    needed: float
    capacity: float

    @property
    def message(self) -> str:
        return (
            f"Tenant `{self.tenant}` has used its budget of {_budget(self)}; this request"
            f" needs {self.needed:.0f} {self.window.unit}."
        )

    @property
    def never_message(self) -> str:
        return (
            f"Tenant `{self.tenant}`'s budget is {_budget(self)}; this request needs at"
            f" least {self.needed:.0f}, more than a whole window holds. It can never start."
        )


class RateStatus(NamedTuple):
    """One unit's figures for the `x-ratelimit-*` headers: the budget of the window that
    binds now (the one with the least left), what is left of it, and the seconds until
    it is full again if nothing more is used."""

    limit: float
    remaining: float
    reset_s: float


@dataclass
class Budgets:
    """The budgets of every tenant on this replica (see the module docstring)."""

    limits: Mapping[str, BudgetLimits] = field(default_factory=dict)
    default_limits: BudgetLimits = NO_BUDGET
    # "alone" (no replicas), "synced" (views flow) or "isolated" (the store is out of reach),
    # and how many replicas share the buckets.
    mode: str = "alone"
    members: int = 1
    # The other replicas' waiters per tenant as of the last exchange: (requests, tokens,
    # when their longest-waiting one came, when the view was published) of each replica.
    peer_waiting: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    _books: dict[str, dict[Window, Bucket]] = field(default_factory=dict)
    _refused: Counter[str] = field(default_factory=Counter)
    _members_seen: tuple[str, ...] = ()

    def limits_for(self, tenant: str) -> BudgetLimits:
        if tenant == DEFAULT_TENANT:
            return NO_BUDGET
        return self.limits.get(tenant, self.default_limits)

    def governs(self, tenant: str) -> bool:
        """Has `tenant` a budget?"""
        return self.limits_for(tenant).any

    # ---- one request -------------------------------------------------------------------------

    def too_big(self, tenant: str, cost: RequestCost) -> BudgetRefusal | None:
        """The window a request exceeds even with its bucket full, if any."""
        limits = self.limits_for(tenant)
        for window in WINDOWS:
            capacity = limits.capacity(window)
            if capacity is not None and _floor(window, cost) > capacity:
                return BudgetRefusal(tenant, window, _floor(window, cost), capacity)
        return None

    def blocked(self, tenant: str, cost: RequestCost, now: float) -> BudgetRefusal | None:
        """The window without room for the request now (None: it may start)."""
        for window, bucket in self._buckets(tenant, now).items():
            need = _need(window, bucket, cost)
            if bucket.free(now) < need - 1e-9:
                return BudgetRefusal(tenant, window, need, bucket.capacity)
        return None

    def wait(
        self,
        tenant: str,
        cost: RequestCost,
        ahead: tuple[float, float],
        now: float,
        since: float | None = None,
    ) -> float:
        """Seconds until every window's refill covers the request after what waits before
        it: `ahead` (tokens, requests) here, and the tenant's waiters elsewhere that came
        before `since` (when the request came; None: now). A view tells only when a
        replica's oldest waiter came: its waiters are taken to have come evenly since."""
        since = now if since is None else since
        requests = tokens = 0.0
        for count, waiting, first, published in self.peer_waiting.get(tenant, ()):
            if first >= since:
                continue
            older = 1.0 if since >= published else (since - first) / (published - first)
            requests += count * older
            tokens += waiting * older
        longest = 0.0
        for window, bucket in self._buckets(tenant, now).items():
            if window.unit == "requests":
                before = ahead[1] + requests
            else:
                before = ahead[0] + tokens
            longest = max(longest, bucket.wait(_need(window, bucket, cost), before, now))
        return longest

    def reserve(self, tenant: str, cost: RequestCost, now: float) -> Reservation | None:
        """Set the request's most aside in every window (None: the tenant has no budget)."""
        buckets = self._buckets(tenant, now)
        if not buckets:
            return None
        amounts = []
        for window, bucket in buckets.items():
            need = _need(window, bucket, cost)
            bucket.advance(now)
            bucket.reserve(need)
            amounts.append((window, bucket, need))
        return Reservation(tenant, amounts)

    def settle(self, reservation: Reservation, used_tokens: float, now: float) -> None:
        """The request ended having used `used_tokens` (prompt + output as the engine
        counted them; 0: it never reached an engine, and counts as no request either).
        Idempotent, so every exit path may call it."""
        if reservation.settled:
            return
        reservation.settled = True
        for window, bucket, amount in reservation.amounts:
            bucket.advance(now)
            if window.unit == "requests":
                bucket.settle(amount, 1.0 if used_tokens > 0 else 0.0)
            else:
                bucket.settle(amount, max(0.0, used_tokens))

    def refused(self, tenant: str) -> None:
        """Count a request of `tenant` refused by its budget."""
        self._refused[tenant] += 1

    # ---- what the shell shows -----------------------------------------------------------------

    def status(self, tenant: str, now: float) -> dict[str, RateStatus]:
        """`tokens` and `requests` figures of a tenant with such budgets (else empty)."""
        out: dict[str, RateStatus] = {}
        for window, bucket in self._buckets(tenant, now).items():
            left = max(0.0, bucket.unreserved(now))
            status = RateStatus(bucket.capacity, left, bucket.reset_s(now))
            unit = window.unit
            if unit not in out or left < out[unit].remaining:
                out[unit] = status
        return out

    def snapshot(self, now: float) -> dict[str, Any]:
        """Per tenant and window: the budget, what is left of it across replicas, this
        replica's reservations, consumption and allowance; and the tenant's refusals."""
        out: dict[str, Any] = {}
        for tenant in sorted(self._books):
            windows = {}
            for window, bucket in self._books[tenant].items():
                windows[window.key] = {
                    "limit": bucket.capacity,
                    "remaining": round(max(0.0, bucket.unreserved(now)), 1),
                    "level": round(bucket.level, 1),
                    "reserved": round(bucket.reserved, 1),
                    "spent": round(bucket.consumed, 1),
                    "allowance": None if bucket.left is None else round(max(0.0, bucket.left), 1),
                    "reset_s": round(bucket.reset_s(now), 3),
                }
            out[tenant] = {"windows": windows, "refused_total": self._refused[tenant]}
        return out

    # ---- replicas (kvgate.core.replicas.exchange) ----------------------------------------------

    def view(self, me: str, part: Part, now: float) -> BudgetView:
        """This replica's budgets for its view: each bucket's counts and its claim on the
        bucket's room (`part`). Publishing them commits the replica to its claims."""
        if self.mode == "alone":
            self.mode = "synced"  # buckets made from now on learn their level from the others
        buckets = {}
        for tenant, book in self._books.items():
            entries = {}
            for window, bucket in book.items():
                entry = bucket.claim(_part_of(part, tenant, window.unit == "requests"), now)
                if entry is not None:
                    entries[window.key] = entry
            if entries:
                buckets[tenant] = entries
        return BudgetView(self._members_seen or (me,), buckets)

    def take(self, views: Sequence[PeerView], members: int, me: str, now: float) -> None:
        """The other live replicas' latest views (`members` counts this one too)."""
        self.mode, self.members = "synced", max(1, members)
        self._members_seen = tuple(sorted({me, *(v.replica for v in views)}))
        for tenant, book in self._books.items():
            for window, bucket in book.items():
                entries = [
                    PeerEntry(
                        v.replica,
                        v.budgets.entry(tenant, window.key),
                        v.age_s,
                        frozenset(v.budgets.members),
                    )
                    for v in views
                ]
                bucket.take(entries, self.members, me, now)
        waiting: dict[str, list[tuple[float, float, float, float]]] = {}
        for view in views:
            published = now - view.age_s
            for tenant, demand in view.tenant_queue.items():
                first = published - demand.head_age_s
                entry = (demand.requests, demand.tokens, first, published)
                waiting.setdefault(tenant, []).append(entry)
        self.peer_waiting = waiting

    def isolate(self, members: int, now: float) -> None:
        """The other replicas cannot be seen: each bucket keeps to 1/`members`."""
        self.mode, self.members = "isolated", max(1, members)
        self.peer_waiting = {}
        for book in self._books.values():
            for bucket in book.values():
                bucket.isolate(self.members, now)

    # ---- helpers --------------------------------------------------------------------------------

    def _buckets(self, tenant: str, now: float) -> dict[Window, Bucket]:
        """The tenant's buckets, made or resized to its budgets as they are configured now."""
        limits = self.limits_for(tenant)
        book = self._books.get(tenant)
        if book is None:
            if not limits.any:
                return {}
            book = self._books[tenant] = {}
        for window in WINDOWS:
            capacity = limits.capacity(window)
            bucket = book.get(window)
            if capacity is None:
                book.pop(window, None)
            elif bucket is None:
                book[window] = self._new(capacity, window, now)
            elif bucket.capacity != capacity:
                bucket.resize(capacity)
        return book

    def _new(self, capacity: int, window: Window, now: float) -> Bucket:
        if self.mode == "alone":
            return Bucket(capacity, window.seconds, now)
        return Bucket.joining(capacity, window.seconds, now, self.members, self.mode == "isolated")


def _part_of(part: Part, tenant: str, whole: bool) -> Callable[[float], float]:
    return lambda room: part(tenant, room, whole)


def _need(window: Window, bucket: Bucket, cost: RequestCost) -> float:
    """What a request reserves in a window: one request, or its most in tokens (at most
    the window's budget: a request that names no output cap may be given the rest of the
    context, yet needs no more than a full bucket)."""
    if window.unit == "requests":
        return 1.0
    return float(min(cost.total, bucket.capacity))


def _floor(window: Window, cost: RequestCost) -> float:
    """The least a request can use in a window (for refusing it as never servable)."""
    return 1.0 if window.unit == "requests" else float(cost.floor_total)


def _budget(refusal: BudgetRefusal) -> str:
    per = "minute" if refusal.window.seconds == 60 else "day"
    return f"{refusal.capacity:.0f} {refusal.window.unit} per {per}"
