"""One tenant's token bucket for one window, as one replica keeps it.

The bucket holds what the tenant may still reserve: at most one window's budget
(`capacity`), refilled continuously at `capacity / window` per second. A request takes its
most (prompt + max_tokens, or one request) out when it starts (`reserve`) and is settled
when it ends (`settle`) with what the engine really produced: what it did not use goes
back, up to a full bucket, and what it used beyond is taken too. So from a full bucket a
tenant consumes at most `capacity x (1 + elapsed / window)`. A settle that charges more
than was reserved (an engine that counted a longer prompt) may take the bucket below zero,
by what was really spent and no more; later requests wait for the refill to make it good.

The books are kept as a *level*: what the tenant has not consumed yet, its reservations
included, at most a window's budget beyond them; what may be reserved is the level less
the reservations. The level falls only by consumption, which only grows: that is what lets
replicas agree on it (`kvgate.core.budgets`).

**Alone**, `free` is the level less the reservations. **With other replicas** every replica
keeps its own estimate of the one level, with a ceiling of a window beyond its own
reservations only (it cannot see the others' at once: a lower ceiling only wastes refill
while the bucket is full), and may reserve only within its *allowance* (`left`): what is
left of the claim it last published, never more than what its estimate leaves beyond every
other replica's reservations and claims (`charges`). Each peer is charged, besides its
reservations and claim, the part of the refill it would take if it were cut off from the
store since its view (`rate / members` per second): a replica that stops hearing from the
store keeps to that part. **Isolated**, a replica keeps what is left of its claim, cut to
1/N of the window, and adds 1/N of the refill up to 1/N of the window.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: A peer's charge for the refill it may take while cut off covers this much beyond the age
#: of its view: the time until some replica's next exchange (two sync periods).
HORIZON_S = 0.1
#: What a request that fits the level but not this replica's allowance waits for: the next
#: exchange, which splits the room again (two sync periods).
CLAIM_WAIT_S = 0.1
#: How long a departed replica's count is remembered, should it come back (a store that
#: restarted empty, a replica cut off for longer than its membership).
GONE_MEMORY_S = 600.0


class Window(NamedTuple):
    """A budget's window: its configuration key, length and unit."""

    key: str
    seconds: float
    unit: str  # "tokens" or "requests"


TOKENS_PER_MINUTE = Window("tokens_per_minute", 60.0, "tokens")
TOKENS_PER_DAY = Window("tokens_per_day", 86_400.0, "tokens")
REQUESTS_PER_MINUTE = Window("requests_per_minute", 60.0, "requests")
WINDOWS = (TOKENS_PER_MINUTE, TOKENS_PER_DAY, REQUESTS_PER_MINUTE)


class BucketEntry(NamedTuple):
    """What a replica publishes of one bucket (`kvgate.core.replicas.view`)."""

    consumed: float  # its consumption counter (only ever grows)
    reserved: float  # its reservations outstanding
    claim: float  # what it may still reserve until its next view
    level: float  # its estimate of the level
    seen: float  # the consumption of the replicas its view names that its level counts


@dataclass(frozen=True, slots=True)
class BudgetView:
    """What a replica publishes of its budgets: each bucket it keeps, and the replicas
    whose consumption its buckets' `seen` sums (itself included)."""

    members: tuple[str, ...] = ()
    buckets: Mapping[str, Mapping[str, BucketEntry]] = field(default_factory=dict)

    def entry(self, tenant: str, window: str) -> BucketEntry | None:
        return self.buckets.get(tenant, {}).get(window)


class PeerEntry(NamedTuple):
    """One other replica's latest view of one bucket, as this replica received it."""

    replica: str
    entry: BucketEntry | None  # None: it publishes nothing of this bucket
    age_s: float  # how long ago it was published
    members: frozenset[str]  # the replicas whose consumption its `seen` sums


@dataclass(slots=True)
class PeerCount:
    """What this replica knows of one other replica's use of the bucket."""

    counted: float  # its consumption, as far as the level counts it
    reserved: float = 0.0
    claim: float = 0.0
    published_at: float = 0.0  # when its latest view was published, on this replica's clock


class Bucket:
    """One tenant's bucket for one window on this replica (see the module docstring).

    `left` is None while the replica admits alone; `seeded` says that the level comes
    from a history the other replicas share (a bucket new to a replica among others waits
    for an exchange to learn it, or starts from nothing while isolated).
    """

    __slots__ = (
        "at",
        "capacity",
        "claimed",
        "consumed",
        "gone",
        "isolated",
        "left",
        "level",
        "members",
        "peers",
        "rate",
        "reserved",
        "seconds",
        "seeded",
        "unclaimed",
    )

    def __init__(self, capacity: float, seconds: float, now: float) -> None:
        self.capacity = float(capacity)
        self.seconds = seconds
        self.rate = self.capacity / seconds
        self.level = self.capacity
        self.at = now
        self.reserved = 0.0  # this replica's reservations outstanding
        self.consumed = 0.0  # this replica's consumption, ever
        self.left: float | None = None
        self.seeded = True
        self.isolated = False
        self.members = 1
        self.claimed = False  # its last view published a claim on this bucket
        self.unclaimed = 0.0  # what is left of that claim (it spends like the allowance)
        self.peers: dict[str, PeerCount] = {}
        self.gone: dict[str, tuple[float, float]] = {}  # departed: (counted, when)

    @classmethod
    def joining(
        cls, capacity: float, seconds: float, now: float, members: int, isolated: bool
    ) -> Bucket:
        """A bucket new to a replica among others: nothing may be reserved until an
        exchange tells its level; isolated, it starts empty and gets its part of the refill."""
        bucket = cls(capacity, seconds, now)
        bucket.seeded = False
        bucket.left = 0.0
        bucket.members = max(1, members)
        if isolated:
            bucket.isolated = True
            bucket.level = 0.0
        return bucket

    # ---- time and the local books ------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Refill up to `now` (and, isolated, this replica's part of the refill)."""
        dt = now - self.at
        if dt <= 0:
            return
        self.at = now
        ceiling = self.capacity + self.reserved
        if self.level < ceiling:
            self.level = min(ceiling, self.level + self.rate * dt)
        if self.isolated and self.left is not None:
            room = self.capacity / self.members
            if self.left < room:
                self.left = min(room, self.left + self.rate / self.members * dt)

    def resize(self, capacity: float) -> None:
        """A reloaded budget: the same level, within the new capacity."""
        self.capacity = float(capacity)
        self.rate = self.capacity / self.seconds
        self.level = min(self.level, self.capacity + self.reserved)

    def free(self, now: float) -> float:
        """What this replica may reserve now."""
        self.advance(now)
        if self.isolated:
            return self.left if self.left is not None else 0.0
        if not self.seeded:
            return 0.0
        room = self.level - self.reserved
        if self.left is None:
            return room
        return min(self.left, room - self.charges(now))

    def reserve(self, amount: float) -> None:
        self.reserved += amount
        self.unclaimed -= amount
        if self.left is not None:
            self.left -= amount

    def settle(self, amount: float, used: float) -> None:
        """A reservation of `amount` ended having consumed `used`."""
        self.reserved -= amount
        self.consumed += used
        self.level = min(self.level - used, self.capacity + self.reserved)
        self.unclaimed += amount - used
        if self.left is not None:
            self.left += amount - used
            if self.isolated:
                self.left = min(self.left, self.capacity / self.members)

    def unreserved(self, now: float) -> float:
        """The level less every replica's reservations: what the tenant may still use now
        (negative after a charge beyond the reservation)."""
        self.advance(now)
        return self.level - self.reserved - sum(p.reserved for p in self.peers.values())

    def wait(self, amount: float, ahead: float, now: float) -> float:
        """Seconds until the refill covers `amount` after `ahead` (waiting before it);
        isolated, until this replica's part of the refill does."""
        if self.isolated:
            left = self.free(now)
            return max(0.0, ahead + amount - left) / (self.rate / self.members)
        short = ahead + amount - self.unreserved(now)
        if short > 0:
            return short / self.rate
        return 0.0 if self.free(now) >= amount else CLAIM_WAIT_S

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again if nothing more is used."""
        return (self.capacity - max(0.0, self.unreserved(now))) / self.rate

    # ---- replicas ------------------------------------------------------------------------------

    def charges(self, now: float) -> float:
        """What the other replicas may use beyond their consumption counted: their
        reservations, their claims, and the part of the refill each would take if cut off
        since its view."""
        return self._held_by_others(now) + sum(p.claim for p in self.peers.values())

    def _held_by_others(self, now: float) -> float:
        """The other replicas' reservations and what each may have taken while cut off."""
        part = self.rate / self.members
        return sum(
            p.reserved + part * max(0.0, now - p.published_at + HORIZON_S)
            for p in self.peers.values()
        )

    def claim(self, part: Callable[[float], float], now: float) -> BucketEntry | None:
        """This replica's entry for its view, to publish now: its `part` of the room the
        level leaves beyond every replica's reservations (isolated: what it keeps). What it
        may reserve until its next exchange can only shrink to the claim."""
        self.advance(now)
        if not self.seeded:
            self.claimed = False
            return None
        if self.isolated:
            claim = max(0.0, self.free(now))
        else:
            slack = max(0.0, self.level - self.reserved - self._held_by_others(now))
            claim = max(0.0, min(slack, part(slack)))
            self.left = claim if self.left is None else min(self.left, claim)
        self.claimed = True
        self.unclaimed = claim
        seen = self.consumed + sum(p.counted for p in self.peers.values())
        return BucketEntry(self.consumed, self.reserved, claim, self.level, seen)

    def take(self, views: Sequence[PeerEntry], members: int, me: str, now: float) -> None:
        """The other live replicas' latest entries, from an exchange that published this
        replica's last `claim()`: count what they consumed, charge what departed replicas
        may have used, learn the level if new here, and set the allowance."""
        self.advance(now)
        self.isolated = False
        live = {view.replica for view in views}
        # A replica gone is charged with the membership it was last seen in, the one whose
        # 1/N it kept to if it was cut off (a store restarted empty counts fewer members
        # until every replica is back in it).
        for name in [name for name in self.peers if name not in live]:
            self._depart(name, now)
        self.members = max(1, members)
        for view in views:
            self._count(view, now)
        if not self.seeded:
            self._seed(views, me, now)
        if self.seeded and self.claimed:
            self.left = min(self.unclaimed, self.level - self.reserved - self.charges(now))
        else:
            self.left = 0.0
        for name in [n for n, (_, at) in self.gone.items() if now - at > GONE_MEMORY_S]:
            del self.gone[name]

    def isolate(self, members: int, now: float) -> None:
        """The store cannot be reached: keep to 1/`members` (see the module docstring)."""
        self.advance(now)
        self.members = max(1, members)
        if self.left is None:
            self.left = self.level - self.reserved
        if not self.isolated:
            self.left = max(0.0, min(self.left, self.capacity / self.members))
            self.isolated = True

    def _depart(self, name: str, now: float) -> None:
        """A replica left the store: whatever it may have used is taken as consumed."""
        peer = self.peers.pop(name)
        part = self.rate / self.members
        used = peer.reserved + peer.claim + part * max(0.0, now - peer.published_at + HORIZON_S)
        self.level -= used
        self.gone[name] = (peer.counted + used, now)

    def _count(self, view: PeerEntry, now: float) -> None:
        entry = view.entry or BucketEntry(0.0, 0.0, 0.0, 0.0, 0.0)
        peer = self.peers.get(view.replica)
        if peer is None:
            counted = self.gone.pop(view.replica, (0.0, now))[0]
            peer = self.peers[view.replica] = PeerCount(counted)
        if self.seeded and entry.consumed > peer.counted:
            self.level -= entry.consumed - peer.counted
        peer.counted = max(peer.counted, entry.consumed)
        peer.reserved = entry.reserved
        peer.claim = entry.claim
        peer.published_at = now - view.age_s

    def _seed(self, views: Sequence[PeerEntry], me: str, now: float) -> None:
        """Learn the level of a bucket new here from a replica that publishes it and whose
        count names only live replicas: its level, refilled since it was published, less
        what the live replicas consumed beyond its count. When none publishes it, the
        bucket is new to all of them and starts full (less what this replica used while
        isolated)."""
        consumed = {view.replica: view.entry.consumed for view in views if view.entry}
        consumed[me] = self.consumed
        live = {me, *(view.replica for view in views)}
        publishers = [view for view in views if view.entry is not None]
        if not publishers:
            self.level = self.capacity - self.consumed
            self.seeded = True
            return
        total = sum(consumed.values())
        candidates = [
            min(self.capacity, view.entry.level + self.rate * view.age_s)
            - (total - view.entry.seen)
            for view in publishers
            if view.entry is not None and view.members <= live
        ]
        if candidates:
            self.level = max(candidates)
            self.seeded = True
