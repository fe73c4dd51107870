"""How a gateway becomes one replica of many: its store from the URL, its core as the
participant, its policy as the sink of shared samples.

An admission object that does not implement `ClusterParticipant` (a policy that keeps no
holds worth sharing) takes part in membership, shards and shared samples only: it
publishes an empty core view and ignores the peers', which `SamplesOnly` says plainly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvgate.cluster.participant import ClusterParticipant, SignalSink
from kvgate.cluster.redis_store import RedisStore
from kvgate.cluster.sync import ClusterSync, new_member_id
from kvgate.core.clock import Clock

log = logging.getLogger(__name__)

_CONTRACT = ("local_view", "set_peer_views", "set_isolated")


class SamplesOnly:
    """The participant of an admission object that shares no admission state."""

    def local_view(self) -> dict[str, Any]:
        return {}

    def set_peer_views(self, views: Sequence[dict[str, Any]], members: int) -> None:
        return None

    def set_isolated(self, members: int) -> None:
        return None


def participant_of(admission: object) -> ClusterParticipant:
    if all(callable(getattr(admission, name, None)) for name in _CONTRACT):
        return admission  # type: ignore[return-value]  # checked structurally above
    log.warning(
        "cluster: %s shares no admission state; replicas share membership, shards and"
        " engine samples only",
        type(admission).__name__,
    )
    return SamplesOnly()


def join(
    url: str,
    admission: object,
    sink: SignalSink,
    clock: Clock,
    *,
    nodes: Callable[[], Iterable[str]],
    expected_members: int = 1,
) -> ClusterSync:
    """The sync task of one replica (not started: the caller owns `run()`)."""
    member_id = new_member_id()
    return ClusterSync(
        RedisStore(url, client_name=f"kvgate-{member_id}"),
        participant_of(admission),
        sink,
        clock,
        nodes=nodes,
        expected_members=expected_members,
        member_id=member_id,
    )
