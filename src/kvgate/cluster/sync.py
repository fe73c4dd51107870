"""The sync task: one replica's link to the others, one store round trip per tick.

Every `SYNC_PERIOD_S` the task publishes this replica's view (a `Publication`, see
`kvgate.cluster.publication`: the core's `local_view()`, its first-hand engine samples, a
few facts for operators) and gets back every live replica's view in the same atomic
exchange (`ClusterStore.exchange`). Then it

- hands the peers' views to the core (`set_peer_views(views, members)`, each a `PeerView`
  with its age on this replica's clock), which counts the other replicas' holds against
  each node and fills only this replica's share of a node's free room;
- assigns engines to members by rendezvous hashing (`kvgate.cluster.shards`): an engine is
  polled by its owner only, and the others feed the owner's samples into their own policy
  (`kvgate.cluster.samples`), so an engine's scrape load does not grow with the replicas;
- keeps the store's clock (`kvgate.cluster.samples.ClockLink`) to carry sample times across.

**The request path never waits for the store.** Admission reads only what the last tick
left in the core.

**Membership.** A member is alive while its heartbeat, renewed by every tick, is younger
than `MEMBER_TTL_S` on the store's clock. A replica killed with SIGKILL stops beating: the
first tick of any replica after its deadline removes it (and its view) from the store, and
every other replica hears no more of it at its own next tick: within `REMOVAL_BOUND_S` (TTL
+ one period + one tick's timeout = 2.2 s). Its requests stay planned, though, until they
would have ended or a sample shows them gone (`kvgate.core.replicas.departed`): a replica
that stopped beating may only be frozen or cut off, its streams still growing in the
engines. A replica that stops cleanly leaves at once.

**When the store fails.** A tick that fails (down, unreachable, refusing the password), or
two in a row that do not complete within `SYNC_TIMEOUT_S` (slow: one late tick may be this
process's own stall), put the replica in *isolated* mode:
`set_isolated(N)`, N being the member count of the last good tick (at least the expected
count given at start), so each replica keeps to 1/N of each node's headroom; and every
engine is scraped locally again, since nobody's samples arrive. It keeps trying, every
period at first, then backing off to `RETRY_MAX_S`; the first good tick (a restarted, empty
store included: each replica simply beats itself back in) returns to normal, no restart.
Before that, once no exchange has succeeded for `STALLED_S` (a stalled store is found
failed only after two timeouts and a reconnect, over a second), every engine is polled
locally again: the peers' samples have stopped arriving, and the engines must not go
stale meanwhile.

**A store never reached.** A replica that has never completed an exchange cannot know what
the others admit, nor how many there are: it admits nothing (`set_isolated(0)`, 503
`store_unreachable`, `ready` False) and logs why at ERROR, the problem named
(`kvgate.cluster.redis_store.problem`), when the reason changes and every
`UNREACHED_LOG_S`. Told how many replicas there are (`expected_members`, `--workers N`),
it keeps to that share instead.

**Shards in flux.** An engine whose owner has not published a view for `SHARED_FRESH_S`
(it died, or is isolated), or does not say that it polls the engine (it does not know it
yet), is scraped locally until the owner's samples come back, so no engine goes unwatched
through a handover. A live owner that is slow to get an answer from a busy engine keeps
it: a poll may take seconds, and every replica polling that engine would load it more.

A replica that is not in sync first reconnects (`ClusterStore.prepare`, bounded by
`PREPARE_TIMEOUT_S`), and only then exchanges under `SYNC_TIMEOUT_S`: a connection
handshake of several round trips must not be cut by the exchange's timeout again and
again, which would keep a replica isolated from a store that answers in time.

Every wait is bounded (the tick by `SYNC_TIMEOUT_S`, leaving by `LEAVE_TIMEOUT_S`); the task
is owned by whoever runs `run()` and cancelling it ends it, leaving the store cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from kvgate.cluster import shards
from kvgate.cluster.publication import Publication, decode
from kvgate.cluster.samples import SHARED_FRESH_S, ClockLink, Record, SampleLedger, SharingSink
from kvgate.cluster.store import ClusterStore, Exchange, StoreError
from kvgate.core.clock import Clock
from kvgate.core.replicas.view import PeerView
from kvgate.core.signals import SignalSink

log = logging.getLogger(__name__)

SYNC_PERIOD_S = 0.05
MEMBER_TTL_S = 2.0
SYNC_TIMEOUT_S = 0.15
LEAVE_TIMEOUT_S = 0.5
#: Connecting (and reloading the script) after a failure may take this long.
PREPARE_TIMEOUT_S = 1.0
RETRY_MAX_S = 1.0
#: A store that does not answer this many ticks in a row within `SYNC_TIMEOUT_S` is slow.
TIMEOUTS_TO_ISOLATE = 2
#: No exchange succeeded for this long: the peers' samples have stopped arriving, so this
#: replica polls every engine itself meanwhile. As long as an owner may stay silent before
#: its engines are polled by all (`SHARED_FRESH_S`): a loaded host delays ticks by a few
#: hundred ms now and then, which must not triple the polls; half of `stale_after_s` is
#: left to sample the engines before they go stale.
STALLED_S = SHARED_FRESH_S
#: How long a SIGKILLed replica stays a member anywhere (documented bound); its requests
#: count until a sample after that shows them gone (`kvgate.core.replicas.departed`).
REMOVAL_BOUND_S = MEMBER_TTL_S + SYNC_PERIOD_S + SYNC_TIMEOUT_S
#: A replica that has never reached its store repeats why this often (and when it changes).
UNREACHED_LOG_S = 60.0

State = Literal["starting", "synced", "isolated"]


def new_member_id() -> str:
    """Unique per process and start: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class ClusterParticipant(Protocol):
    """The core's side of replication (its flow controller): the sync task publishes its
    `local_view()` every tick and hands the other live replicas' views back through
    `set_peer_views`; while the store cannot be reached it calls `set_isolated` instead,
    and the core keeps to a safe share of each node's headroom. The core never imports
    this package; it only has to have these three methods."""

    def local_view(self) -> PeerView:
        """This replica's live holds per node, claims, queue demand, tenant usage and
        fairness counters (`kvgate.core.replicas.view`)."""
        ...

    def set_peer_views(self, views: Sequence[PeerView], members: int) -> None:
        """The other live replicas' latest views, and how many replicas are live (this one
        included)."""
        ...

    def set_isolated(self, members: int) -> None:
        """The store is unreachable: keep to a 1/`members` share of each node's headroom
        until `set_peer_views` is called again."""
        ...


@dataclass(slots=True)
class SyncStats:
    """What the sync task counts, for /admin/state and Prometheus."""

    exchanges_total: int = 0
    failures_total: int = 0
    isolations_total: int = 0
    last_latency_s: float | None = None
    last_ok_at: float | None = None
    last_error: str | None = None
    isolated_since: float | None = None
    view_bytes: int = 0
    _latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096), repr=False)

    def drain_latencies(self) -> list[float]:
        """Exchange round trips since the last call (the newest 4096 at most)."""
        out = list(self._latencies)
        self._latencies.clear()
        return out


@dataclass(frozen=True, slots=True)
class _Peer:
    """One peer's blob as read: its publication, its core view, and when it was published
    (this replica's clock; None when it does not say)."""

    publication: Publication | None
    view: PeerView | None
    published_at: float | None

    def aged(self, now: float) -> PeerView:
        """Its core view with its age: the core compares how long each replica's queue head
        has waited at one instant."""
        assert self.view is not None
        if self.published_at is None:
            return self.view
        return replace(self.view, age_s=max(0.0, now - self.published_at))


class ClusterSync:
    """Shares this replica's admission state and engine samples through `store`.

    `participant` is the core's admission object; `sink` is where engine samples go (the
    policy): the scraper must feed `self.sink` instead, so that its samples are published,
    and skip the engines for which `scrapes(node_id)` is False. `nodes` returns the ids of
    the engines this replica serves now. `expected_members` is how many replicas to assume
    when the store is down from the start (e.g. `--workers N`); without it (or with 1) a
    replica that has never reached its store admits nothing (see the module docstring).
    `agreed` holds the settings every replica must have alike (`publication.agreed`; none
    until the caller sets them): each publishes its own and warns of a peer whose differ.
    """

    def __init__(
        self,
        store: ClusterStore,
        participant: ClusterParticipant,
        sink: SignalSink,
        clock: Clock,
        *,
        nodes: Callable[[], Iterable[str]],
        expected_members: int | None = None,
        member_id: str | None = None,
    ) -> None:
        self.store = store
        self.participant = participant
        self.clock = clock
        self.member_id = member_id or new_member_id()
        self.expected_members = (
            expected_members if expected_members and expected_members > 1 else None
        )
        self.agreed: dict[str, float] = {}
        self.ledger = SampleLedger()
        self.sink = SharingSink(sink, self.ledger, clock)
        self._target = sink
        self.link = ClockLink()
        self.stats = SyncStats()
        self.state: State = "starting"
        self.members: tuple[str, ...] = ()
        self.shards: dict[str, str] = {}
        self._nodes = nodes
        self._peers: dict[str, Publication | None] = {}
        self._remote: frozenset[str] = frozenset()  # engines scraped by their owner, not us
        self._assigned: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._bad_peers: set[str] = set()
        self._disagreeing: set[str] = set()  # peers warned of for settings unlike ours
        self._timeouts = 0  # consecutive ticks without an answer in time
        self._told: tuple[str, float] | None = None  # the last never-synced ERROR: why, when

    # ---- what the scraper asks ---------------------------------------------------------

    def scrapes(self, node_id: str) -> bool:
        """Should this replica poll `node_id` itself now? Yes unless its owner shares its
        samples, and they still arrive: once no exchange has succeeded for `STALLED_S`,
        every engine is polled here again, well before its last shared sample is stale
        (the store may be stalled, long before it is found failed)."""
        if node_id not in self._remote:
            return True
        last = self.stats.last_ok_at
        return last is None or self.clock.now() - last > STALLED_S

    @property
    def ready(self) -> bool:
        """May this replica admit: it has reached its store once, or it knows how many
        replicas share the engines (`expected_members`)."""
        return self.stats.exchanges_total > 0 or self.expected_members is not None

    @property
    def remote(self) -> frozenset[str]:
        """Engines this replica learns through the store instead of polling them."""
        return self._remote

    # ---- running -------------------------------------------------------------------------

    async def run(self) -> None:
        """Sync until cancelled; then leave the store (bounded) and close it."""
        loop = asyncio.get_running_loop()
        self._call(self.participant.set_isolated, self.expected_members or 0)  # until a tick
        failures = 0
        try:
            while True:
                started = loop.time()
                ok = await self.tick()
                failures = 0 if ok else failures + 1
                delay = SYNC_PERIOD_S if ok else min(RETRY_MAX_S, SYNC_PERIOD_S * 2**failures)
                await asyncio.sleep(max(0.0, started + delay - loop.time()))
        finally:
            try:
                with contextlib.suppress(StoreError, TimeoutError):
                    async with asyncio.timeout(LEAVE_TIMEOUT_S):
                        await self.store.leave(self.member_id)
            finally:
                await self.store.close()

    async def tick(self) -> bool:
        """One exchange with the store; False when it failed (the replica is isolated)."""
        if self.state != "synced" or self._timeouts:
            try:  # reconnect and reload outside the exchange's tighter timeout
                async with asyncio.timeout(PREPARE_TIMEOUT_S):
                    await self.store.prepare()
            except StoreError as exc:
                self._isolate(str(exc))
                return False
            except TimeoutError:
                self._isolate(f"could not connect within {PREPARE_TIMEOUT_S:.0f} s")
                return False
        blob = self.outgoing()
        sent_at = self.clock.now()
        try:
            async with asyncio.timeout(SYNC_TIMEOUT_S):
                reply = await self.store.exchange(self.member_id, blob, MEMBER_TTL_S)
        except StoreError as exc:
            self.failed(str(exc))
            return False
        except TimeoutError:
            self.failed(f"no answer within {SYNC_TIMEOUT_S * 1000:.0f} ms", timeout=True)
            return False
        self._answered(reply, sent_at, self.clock.now())
        peers: dict[str, _Peer] = {}
        for member, view in reply.views.items():
            if member != self.member_id:
                peers[member] = self._read(member, view)
                await asyncio.sleep(0)  # requests due meanwhile wait for one view, not all
        self._apply(peers, reply.views.keys(), self.clock.now())
        return True

    # ---- one tick's halves: also how a virtual-time simulation drives a replica ---------

    def outgoing(self) -> bytes:
        """This replica's view, to publish now."""
        blob = self._publication(self.clock.now()).encode()
        self.stats.view_bytes = len(blob)
        return blob

    def incoming(self, reply: Exchange, sent_at: float, received_at: float) -> None:
        """The store's answer to the view sent at `sent_at`, received at `received_at`."""
        self._answered(reply, sent_at, received_at)
        me = self.member_id
        peers = {m: self._read(m, view) for m, view in reply.views.items() if m != me}
        self._apply(peers, reply.views.keys(), received_at)

    def _answered(self, reply: Exchange, sent_at: float, received_at: float) -> None:
        self._timeouts = 0
        self.link.observe(sent_at, received_at, reply.store_time)
        self.stats.exchanges_total += 1
        self.stats.last_latency_s = received_at - sent_at
        self.stats._latencies.append(received_at - sent_at)
        self.stats.last_ok_at = received_at

    def failed(self, reason: str, *, timeout: bool = False) -> None:
        """An exchange failed (`timeout`: it had no answer in time)."""
        if not timeout:
            self._isolate(reason)
            return
        self._timeouts += 1
        if self._timeouts >= TIMEOUTS_TO_ISOLATE:
            self._isolate(reason)
        else:  # one late answer may be this process's own stall, not the store's
            self.stats.failures_total += 1
            self.stats.last_error = reason

    # ---- one tick's work -------------------------------------------------------------------

    def _publication(self, now: float) -> Publication:
        view = self._call(self.participant.local_view)
        samples = self.ledger.records(now, self.link) if self.link.known else {}
        meta = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": self.state,
            "scrapes": sorted(n for n in self.served_nodes() if n not in self._remote),
            "at": self.link.to_store(now) if self.link.known else None,
            "agreed": self.agreed,
        }
        core = view.to_json() if isinstance(view, PeerView) else {}
        return Publication(core, samples, meta)

    def _read(self, member: str, blob: bytes) -> _Peer:
        """A peer's blob, decoded: its publication and its core view (None when this
        version cannot read it), and when it was published on this replica's clock."""
        pub = decode(blob)
        if pub is None:
            if member not in self._bad_peers:
                self._bad_peers.add(member)
                log.warning("cluster: member %s publishes a view this version cannot read", member)
            return _Peer(None, None, None)
        at = pub.meta.get("at")
        published = self.link.to_local(at) if isinstance(at, int | float) else None
        return _Peer(pub, PeerView.from_json(pub.core), published)

    def _apply(self, peers: dict[str, _Peer], live: Iterable[str], now: float) -> None:
        """Take the live members and their views (`peers`: every live one but this one)."""
        me = self.member_id
        self._peers = {m: peer.publication for m, peer in peers.items()}
        self.members = tuple(sorted({*live, me}))
        for member, pub in self._peers.items():
            if pub is not None and member not in self._disagreeing:
                self._check_agreed(member, pub)
        served = self.served_nodes()
        self.ledger.keep_only(set(served))
        key = (self.members, served)
        if key != self._assigned:  # rendezvous hashing only when members or engines change
            self.shards = shards.assign(served, self.members)
            self._assigned = key
        remote = set()
        for node_id in served:
            # The newest record of any peer (pushed samples reach one replica only); the
            # policy ignores a sample older than the one it holds.
            newest = self._newest_record(node_id)
            if newest is not None:
                self._call(self.ledger.feed, node_id, newest, self.link, self._target)
            owner = self.shards[node_id]
            if owner == me:
                continue
            if self._served_by(owner, node_id, now):
                remote.add(node_id)
        self._remote = frozenset(remote)
        views_in = [peer.aged(now) for peer in peers.values() if peer.view is not None]
        self._call(self.participant.set_peer_views, views_in, len(self.members))
        if self.state == "isolated" and self.stats.isolated_since is not None:
            log.info(
                "cluster store %s is back after %.1f s: %d replica(s) live",
                self.store.describe(),
                now - self.stats.isolated_since,
                len(self.members),
            )
        elif self.state == "starting":
            log.info(
                "cluster store %s: member %s, %d replica(s) live",
                self.store.describe(),
                me,
                len(self.members),
            )
        self.state = "synced"
        self.stats.isolated_since = None
        self.stats.last_error = None

    def _isolate(self, reason: str) -> None:
        self.stats.failures_total += 1
        self.stats.last_error = reason
        self._remote = frozenset()  # nobody's samples arrive: scrape everything
        if self.stats.exchanges_total == 0:
            self._unreached(reason)
            return
        members = max(len(self.members), self.expected_members or 1)
        if self.state != "isolated":
            log.warning(
                "cluster store %s failed (%s): isolated, keeping a 1/%d share of each node",
                self.store.describe(),
                reason,
                members,
            )
            self.state = "isolated"
            self.stats.isolations_total += 1
            self.stats.isolated_since = self.clock.now()
        # Every failed tick: the departed replicas' requests age (kvgate.core.replicas).
        self._call(self.participant.set_isolated, members)

    def _unreached(self, reason: str) -> None:
        """The store has never been reached: say why, loudly, when the reason changes and
        every `UNREACHED_LOG_S`; admit within the expected share, or not at all."""
        now = self.clock.now()
        told = self._told
        if told is None or told[0] != reason or now - told[1] >= UNREACHED_LOG_S:
            self._told = (reason, now)
            if self.expected_members is not None:
                then = f"it keeps a 1/{self.expected_members} share of each node until it does"
            else:
                then = (
                    "it cannot know what the other replicas admit, so it admits nothing"
                    " (503 store_unreachable, /readyz 503) until it does"
                )
            log.error(
                "cluster store %s unusable: %s. This replica has never reached it: %s",
                self.store.describe(),
                reason,
                then,
            )
        self._call(self.participant.set_isolated, self.expected_members or 0)

    def _check_agreed(self, member: str, pub: Publication) -> None:
        theirs = pub.meta.get("agreed")
        if not isinstance(theirs, dict):
            return
        differ = sorted(k for k, v in self.agreed.items() if k in theirs and theirs[k] != v)
        if differ:
            self._disagreeing.add(member)
            log.warning(
                "cluster: member %s admits with %s where this replica has %s: replicas that"
                " share a store must agree on these, or they plan the same room differently",
                member,
                ", ".join(f"{k}={theirs[k]}" for k in differ),
                ", ".join(f"{k}={self.agreed[k]}" for k in differ),
            )

    def _served_by(self, owner: str, node_id: str, now: float) -> bool:
        """Does `owner` poll `node_id` for us: its view was published lately, says it polls
        the engine and holds a record of it? The age of the record does not matter: the
        poll of a busy engine may take seconds (the scraper waits for it), and polling it
        from every replica then would only load it more."""
        pub = self._peers.get(owner)
        if pub is None or node_id not in (pub.meta.get("scrapes") or ()):
            return False
        published = pub.meta.get("at")
        if not isinstance(published, int | float):
            return False
        return self.link.to_local(published) >= now - SHARED_FRESH_S and node_id in pub.samples

    def _newest_record(self, node_id: str) -> Record | None:
        newest: Record | None = None
        for pub in self._peers.values():
            record = None if pub is None else pub.record(node_id)
            if record is not None and (newest is None or record.attempt_at > newest.attempt_at):
                newest = record
        return newest

    def served_nodes(self) -> tuple[str, ...]:
        """The engines this replica serves now, sorted."""
        return tuple(sorted(self._nodes()))

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """The core and the policy are pure code: a bug there must not stop the sync."""
        try:
            return fn(*args)
        except Exception:
            log.exception("cluster: %s failed", getattr(fn, "__qualname__", fn))
            return None

    # ---- reading ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for /admin/state, the dashboard and `kvgate status`."""
        now = self.clock.now()
        stats = self.stats
        owned = shards.by_member(self.shards)
        members = []
        for member in self.members or (self.member_id,):
            pub = None if member == self.member_id else self._peers.get(member)
            meta = pub.meta if pub is not None else {}
            mine = member == self.member_id
            members.append(
                {
                    "id": member,
                    "self": mine,
                    "host": socket.gethostname() if mine else meta.get("host"),
                    "pid": os.getpid() if mine else meta.get("pid"),
                    "state": self.state if mine else meta.get("state"),
                    "owns": owned.get(member, []),
                    "scrapes": sorted(n for n in self.served_nodes() if self.scrapes(n))
                    if mine
                    else meta.get("scrapes"),
                }
            )
        return {
            "member_id": self.member_id,
            "state": self.state,
            "ready": self.ready,
            "expected_members": self.expected_members,
            "store": self.store.describe(),
            "replicas": len(self.members) if self.members else None,
            "members": members,
            "shards": dict(self.shards),
            "sync": {
                "period_s": SYNC_PERIOD_S,
                "member_ttl_s": MEMBER_TTL_S,
                "timeout_s": SYNC_TIMEOUT_S,
                "removal_bound_s": REMOVAL_BOUND_S,
                "last_latency_ms": None
                if stats.last_latency_s is None
                else stats.last_latency_s * 1000,
                "exchanges_total": stats.exchanges_total,
                "failures_total": stats.failures_total,
                "isolations_total": stats.isolations_total,
                "last_error": stats.last_error,
                "last_ok_age_s": None if stats.last_ok_at is None else now - stats.last_ok_at,
                "isolated_for_s": None
                if stats.isolated_since is None
                else now - stats.isolated_since,
                "view_bytes": stats.view_bytes,
                "clock_uncertainty_ms": self.link.uncertainty_s * 1000 if self.link.known else None,
            },
        }
