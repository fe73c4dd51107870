"""What the cluster sync talks to: the core's admission object, and the scraper's sink.

`ClusterParticipant` is the core's side of replication, a pure and JSON-able exchange: the
sync task publishes `local_view()` to the store every tick and hands the other live
replicas' views back through `set_peer_views`; while the store cannot be reached it calls
`set_isolated` instead, and the core keeps to a safe share of each node's headroom. The
core never imports this package; it only has to have these three methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvgate.core.signals import NodeSample


class ClusterParticipant(Protocol):
    """Implemented by the core's admission object."""

    def local_view(self) -> dict[str, Any]:
        """A JSON-able summary of this replica's live holds per node, queue demand, tenant
        usage and fairness counters."""
        ...

    def set_peer_views(self, views: Sequence[dict[str, Any]], members: int) -> None:
        """The other live replicas' latest views, and how many replicas are live (this one
        included)."""
        ...

    def set_isolated(self, members: int) -> None:
        """The store is unreachable: keep to a 1/`members` share of each node's headroom
        until `set_peer_views` is called again."""
        ...


class SignalSink(Protocol):
    """Where engine samples go (the admission policy): the scraper's sink, and ours."""

    def observe(self, node_id: str, sample: NodeSample) -> None: ...

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        """A failed scrape; not `hard` when it was only abandoned unanswered (a busy engine)."""
        ...
