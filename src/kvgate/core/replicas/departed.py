"""Departed replicas: the requests of a replica this one no longer hears from, planned
until they would have ended or a sample shows them gone.

A replica's view stops arriving when its heartbeat expires (it was killed, frozen, or cut
off from the store while it still reaches the engines) or when this replica is isolated
and hears from nobody. Its requests may still run on the engines and grow there: a frozen
process's streams go on in the engine, which does not know its client stopped reading. So
its last view is not forgotten with its membership: each of its requests stays in every
node's envelope, as the view told it (tokens held, steps remaining), aged by the time since
it was published at the node's pace, until it would have ended.

**Aging errs on the safe side.** The engine's pace is not the one its requests had when
they were published: a busier engine runs slower. So a departed request's remaining steps
shrink at `AGING_MARGIN` times the node's slower pace (its streams' pace or its samples'
step, whichever is slower), which over-estimates what it has left, and it is counted as
holding what it held then plus what it grew at that pace (an under-estimate of what it
frees at its end: safe, see `kvgate.core.plan.envelope`). What it grew since the node's
last sample, which that sample cannot contain, is counted at the node's fastest pace.

**A sample can prove a request gone.** A request that a sample had already seen when its
replica published (the tokens it held less those no sample contained) is in every later
sample while it runs. A sample taken after the view was published that holds less, beyond
what this replica's own requests and the live replicas' requests account for, than the
departed requests seen before, shows that some of them ended: the largest are dropped until
the rest fit in what the sample leaves unexplained. A SIGKILLed replica's requests are
aborted by the engine when their connections close, so the next sample drops them. A
request no sample had seen when its replica departed is kept until its expected end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvgate.core.replicas.view import PeerHold, PeerView

#: A departed request's remaining steps shrink at this many times the node's slower pace.
AGING_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class NodeView:
    """What this replica knows of one node, for aging and proving departed requests."""

    slow_step_s: float  # seconds per step, the slower of the node's measured paces
    fast_step_s: float  # the fastest it may run (its healthy step)
    sampled_at: float | None  # its last sample (None: none yet)
    unexplained: float  # tokens of that sample that no live request accounts for


@dataclass(slots=True)
class _Replica:
    """A departed replica's requests per node, as its last view told them."""

    published_at: float
    nodes: dict[str, list[PeerHold]] = field(default_factory=dict)


class Departed:
    """The replicas this one heard from and no longer hears, with their requests."""

    def __init__(self, node_view: Callable[[str], NodeView]) -> None:
        self._node_view = node_view
        self._last: dict[str, tuple[float, PeerView]] = {}  # live: (published at, view)
        self._departed: dict[str, _Replica] = {}

    def __bool__(self) -> bool:
        """Are any departed replicas' requests still planned?"""
        return bool(self._departed)

    def heard(self, views: Iterable[PeerView], now: float) -> None:
        """The other replicas' views heard now: one heard before and not now departed; one
        heard again is live again (its view tells its requests)."""
        last = {view.replica: (now - view.age_s, view) for view in views}
        for replica, (published, view) in self._last.items():
            if replica not in last:
                self._depart(replica, published, view)
        for replica in last:
            self._departed.pop(replica, None)
        self._last = last

    def isolated(self) -> None:
        """Nobody can be heard: every replica heard last has departed."""
        for replica, (published, view) in self._last.items():
            self._depart(replica, published, view)
        self._last = {}

    def requests(self) -> dict[str, int]:
        """How many departed requests each node still plans."""
        out: dict[str, int] = {}
        for replica in self._departed.values():
            for node_id, holds in replica.nodes.items():
                out[node_id] = out.get(node_id, 0) + len(holds)
        return out

    def views(self, now: float, explained: Mapping[str, float]) -> list[PeerView]:
        """The departed replicas' requests as views published now, aged; `explained[node]`:
        tokens the live replicas' requests account for in the node's last sample, beyond
        this replica's own. Requests that ended (aged out, or shown gone by a sample) are
        dropped for good."""
        views: dict[str, dict[str, tuple[PeerHold, ...]]] = {}
        nodes: dict[str, NodeView] = {}
        for node_id in {n for replica in self._departed.values() for n in replica.nodes}:
            node = self._node_view(node_id)
            nodes[node_id] = node
            self._prove(node_id, node, node.unexplained - explained.get(node_id, 0.0))
        for name, replica in list(self._departed.items()):
            out: dict[str, tuple[PeerHold, ...]] = {}
            for node_id, holds in list(replica.nodes.items()):
                node = nodes[node_id]
                holds[:] = [h for h in holds if _remaining(h, replica, node, now) > 0]
                if holds:
                    out[node_id] = tuple(_aged(h, replica, node, now) for h in holds)
                else:
                    del replica.nodes[node_id]
            if not replica.nodes:
                del self._departed[name]
            elif out:
                views[name] = out
        return [PeerView(name, nodes=out) for name, out in views.items()]

    def _depart(self, replica: str, published: float, view: PeerView) -> None:
        nodes = {n: list(holds) for n, holds in view.nodes.items() if holds}
        if nodes:
            self._departed[replica] = _Replica(published, nodes)

    def _prove(self, node_id: str, node: NodeView, unexplained: float) -> None:
        """Drop the node's departed requests a sample shows gone (the module docstring)."""
        seen: list[tuple[float, float, list[PeerHold], PeerHold]] = []
        for replica in self._departed.values():
            holds = replica.nodes.get(node_id)
            if not holds or node.sampled_at is None or node.sampled_at <= replica.published_at:
                continue
            for hold in holds:
                reflected = hold.held - hold.unreflected
                if reflected > 0:
                    seen.append((hold.held + hold.remaining, reflected, holds, hold))
        if sum(s[1] for s in seen) <= unexplained:
            return
        room = max(0.0, unexplained)
        for _, reflected, holds, hold in sorted(seen, key=lambda s: s[0], reverse=True):
            if reflected <= room:
                room -= reflected
            else:
                holds.remove(hold)


def _remaining(hold: PeerHold, replica: _Replica, node: NodeView, now: float) -> float:
    """Steps the request may still have to run, over-estimated (aged at a slow pace)."""
    return hold.remaining - (now - replica.published_at) / (node.slow_step_s * AGING_MARGIN)


def _aged(hold: PeerHold, replica: _Replica, node: NodeView, now: float) -> PeerHold:
    """The request as a view published now would tell it."""
    since = now - replica.published_at
    grown = min(hold.remaining, since / (node.slow_step_s * AGING_MARGIN))
    sampled = node.sampled_at
    if sampled is None or sampled <= replica.published_at:
        unseen = hold.unreflected + min(hold.remaining, since / node.fast_step_s)
    else:  # the node's last sample holds it as it was then
        unseen = min(hold.remaining, (now - sampled) / node.fast_step_s)
    return PeerHold(unseen, hold.held + grown, hold.remaining - grown, hold.age_s + since)
