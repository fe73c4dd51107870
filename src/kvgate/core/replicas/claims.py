"""This replica's claims on each node's slack, and what it may still add before the next sync.

Between two syncs replicas cannot see each other's new admissions, so each one, when it
publishes its view, claims part of every node's *slack* (its panic ceiling less its planned
peak, `kvgate.core.plan.forecast`) and, until its next sync, adds requests to a node only
within what is left of its claim *and* of the slack the others' published claims leave (its
*allowance*). Every start spends from both. How the slack is split is `peers.share_of`; why
the claims of two replicas never overlap is in `kvgate.core.replicas.peers`.

**Isolated** (no view can be exchanged), a replica has no claims: it keeps to its static
part of each node, `1/members` of the room under the ceiling for its own requests
(`isolated_headroom`), and the node's whole envelope (the last sample, its own requests and
the departed replicas' ones, `kvgate.core.replicas.departed`) must stay under the ceiling
too. A request larger than that part starts only when the replica has nothing else running
on the node: it then takes what the envelope leaves. That is a bet that no other isolated
replica starts one in the same moment (it cannot know); it is what lets a large request
start at all while the store is down, and a replica makes it for one request at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvgate.core.nodes import NodeState
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Holds
from kvgate.core.prefix.held import PromptSharing
from kvgate.core.replicas.departed import NodeView
from kvgate.core.replicas.peers import PeerState
from kvgate.core.replicas.view import PeerHold
from kvgate.core.settings import AdmissionSettings

_new_tuple = tuple.__new__  # a PeerHold without NamedTuple's argument handling (hot path)
_INF = float("inf")


class Claims:
    """The claims this replica published at its last sync and what is left of them."""

    __slots__ = ("_forecast", "_holds", "_nodes", "_panic", "_sharing", "claimed", "left")

    def __init__(
        self,
        settings: AdmissionSettings,
        nodes: Mapping[str, NodeState],
        holds: Holds,
        forecast: Forecast,
        sharing: PromptSharing | None = None,
    ) -> None:
        self._panic = settings.panic_watermark
        self._nodes = nodes
        self._holds = holds
        self._forecast = forecast
        self._sharing = sharing
        self.claimed: dict[str, float] = {}  # what is left of the published claims
        # What this replica may still add per node until the next sync (final footprints);
        # a node not listed: no limit (no peers, or isolated).
        self.left: dict[str, float] = {}

    @property
    def peers(self) -> PeerState:
        """The other replicas, as of the last sync."""
        return self._forecast.peers

    def slack(self, node_id: str) -> float:
        """What the node may still take under its panic ceiling at its planned peak."""
        node = self._nodes.get(node_id)
        if node is None or node.cap is None:
            return 0.0
        return max(0.0, self._panic * node.cap - self._forecast.envelope(node).peak())

    def isolated_headroom(
        self, node: NodeState, limit: float, held: int, expected: int
    ) -> float | None:
        """Isolated: the fraction of the node's capacity left after a newcomer that holds
        `held` now and runs `expected` steps, within this replica's part (see the module
        docstring); None when it does not fit."""
        cap = node.cap
        members = self._forecast.peers.members
        if cap is None or members <= 0:
            return None
        whole = self._forecast.envelope(node).peak(held, expected)
        if whole > limit:
            return None
        own = self._forecast.own_envelope(node.node_id)
        part = limit / members
        mine = own.peak(held, expected)
        if mine <= part:
            return (part - mine) / cap
        if len(own) == 0:  # alone on the node, as far as this replica knows: a larger part
            return (limit - whole) / cap
        return None

    def node_view(self, node_id: str) -> NodeView:
        """The node as `kvgate.core.replicas.departed` ages and proves departed requests."""
        pace = self._forecast.pace
        node = self._nodes.get(node_id)
        sample = None if node is None else node.sample
        step = pace.step_s(node_id)
        slow = max(step, (node.step_s if node is not None else None) or 0.0)
        fast = min(step, pace.fastest_step_s(node_id))
        if sample is None or node is None or node.cap is None or sample.kv_usage is None:
            return NodeView(slow, fast, None if sample is None else sample.sampled_at, _INF)
        book = self._holds.books.get(node_id)
        own = sum(h.reflected for h in book.holds.values()) if book is not None else 0
        return NodeView(slow, fast, sample.sampled_at, node.used - own)

    def allowance(self, node_id: str) -> float | None:
        """Tokens (final footprints) this replica may still add to the node before the next
        sync; None when it is alone (no peers, not isolated)."""
        return self.left.get(node_id)

    def allowances(self) -> dict[str, float | None]:
        """`allowance` of every node."""
        return {node_id: self.left.get(node_id) for node_id in self._nodes}

    def spend(self, node_id: str, footprint: int) -> None:
        """A request that will hold `footprint` tokens at its end started on the node."""
        self.left[node_id] -= footprint
        if node_id in self.claimed:
            self.claimed[node_id] -= footprint

    def claim(self, share: Callable[[str, float], float]) -> dict[str, float]:
        """This replica's claims, to publish now: `share(node, slack)` of each node's slack.
        What it may add before its next sync can only shrink to the claim, since the others
        plan around the claim from now on."""
        claims: dict[str, float] = {}
        for node_id in self._nodes:
            slack = self.slack(node_id)
            claims[node_id] = share(node_id, slack) * slack
            left = self.left.get(node_id)
            if left is not None:
                self.left[node_id] = min(left, claims[node_id])
        self.claimed = claims
        return {n: round(c, 1) for n, c in claims.items()}

    def set_peers(self, state: PeerState) -> None:
        """Take the other replicas' state (their holds and claims) from an exchange that
        published this replica's last `claim()`: until the next one it may add to a node
        what is left of its claim, and only what the others' claims leave of the slack;
        isolated, the node's room is split statically instead (see `kvgate.core.replicas`)."""
        self._forecast.set_peers(state)
        self.left = {}
        if state.isolated or state.members <= 1:
            self.claimed = {}
            return
        for node_id in self._nodes:
            peers = state.nodes.get(node_id)
            free = self.slack(node_id) - (0.0 if peers is None else peers.claimed)
            self.left[node_id] = max(0.0, min(self.claimed.get(node_id, 0.0), free))

    def prefixes(self) -> dict[str, tuple[int, ...]]:
        """Per node, the marks of the prefixes this replica's requests hold there, as its
        view tells them to the others (`kvgate.core.prefix.held`)."""
        if self._sharing is None:
            return {}
        return {n: tuple(marks) for n, marks in self._sharing.held.marks().items()}

    def local_holds(self, now: float) -> dict[str, tuple[PeerHold, ...]]:
        """This replica's requests per node, as its view tells them to the others (age:
        seconds since the request was sent to the engine)."""
        overhead = self._holds.overhead
        out: dict[str, tuple[PeerHold, ...]] = {}
        for node_id, book in self._holds.books.items():
            holds = []
            for h in book.holds.values():
                held = h.prompt + h.tok_cur + overhead
                age = round(now - h.ticket.admitted_at, 3)
                holds.append(_new_tuple(PeerHold, (held - h.reflected, held, h.remaining(), age)))
            out[node_id] = tuple(holds)
        return out
