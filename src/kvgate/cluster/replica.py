"""How a gateway becomes one replica of many: its store from the URL, and its admission
core (the flow controller) as both the participant whose views are exchanged and the sink
of the engine samples other replicas scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from kvgate.cluster.publication import agreed
from kvgate.cluster.redis_store import RedisStore
from kvgate.cluster.sync import ClusterParticipant, ClusterSync, new_member_id
from kvgate.core.clock import Clock
from kvgate.core.replicas.exchange import ReplicaExchange
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import SignalSink


class Admission(ClusterParticipant, SignalSink, Protocol):
    """The core object a replica shares: views out and in, samples in."""

    @property
    def exchange(self) -> ReplicaExchange:
        """Its side of the exchange, which carries its name among the replicas."""
        ...


def join(
    url: str,
    admission: Admission,
    clock: Clock,
    *,
    nodes: Callable[[], Iterable[str]],
    expected_members: int | None = None,
    settings: AdmissionSettings | None = None,
) -> ClusterSync:
    """The sync task of one replica (not started: the caller owns `run()`). The admission
    core takes the member id as its replica name, the one its views carry; `settings` are
    its admission settings, those the replicas must have alike are published."""
    member_id = new_member_id()
    admission.exchange.replica = member_id
    sync = ClusterSync(
        RedisStore(url, client_name=f"kvgate-{member_id}"),
        admission,
        admission,
        clock,
        nodes=nodes,
        expected_members=expected_members,
        member_id=member_id,
    )
    if settings is not None:
        sync.agreed = agreed(settings)
    return sync
