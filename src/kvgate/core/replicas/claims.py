"""This replica's claims on each node's slack, and what it may still add before the next sync.

Between two syncs replicas cannot see each other's new admissions, so each one, when it
publishes its view, claims part of every node's *slack* (its panic ceiling less its planned
peak, `kvgate.core.plan.forecast`) and, until its next sync, adds requests to a node only
within what is left of its claim *and* of the slack the others' published claims leave (its
*allowance*). Every start spends from both. How the slack is split is `peers.share_of`; why
the claims of two replicas never overlap is in `kvgate.core.replicas.peers`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvgate.core.nodes import NodeState
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Holds
from kvgate.core.replicas.peers import PeerState
from kvgate.core.replicas.view import PeerHold
from kvgate.core.settings import AdmissionSettings

_new_tuple = tuple.__new__  # a PeerHold without NamedTuple's argument handling (hot path)


class Claims:
    """The claims this replica published at its last sync and what is left of them."""

    __slots__ = ("_forecast", "_holds", "_nodes", "_panic", "claimed", "left")

    def __init__(
        self,
        settings: AdmissionSettings,
        nodes: Mapping[str, NodeState],
        holds: Holds,
        forecast: Forecast,
    ) -> None:
        self._panic = settings.panic_watermark
        self._nodes = nodes
        self._holds = holds
        self._forecast = forecast
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
