"""The sync task against the in-process store, on a manual clock: views, membership,
isolation and recovery, shards and shared samples, tick by tick."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from kvgate.cluster import publication
from kvgate.cluster.samples import SHARED_FRESH_S
from kvgate.cluster.shards import owner
from kvgate.cluster.store import MemoryStore
from kvgate.cluster.sync import MEMBER_TTL_S, STALLED_S, SYNC_PERIOD_S, ClusterSync
from kvgate.core.clock import ManualClock
from kvgate.core.replicas.view import PeerView
from kvgate.core.signals import NodeSample

from .conftest import RecordingParticipant, RecordingSink

NODES = [f"engine-{i}" for i in range(12)]


@dataclass
class Replica:
    sync: ClusterSync
    core: RecordingParticipant
    policy: RecordingSink


def cluster(n: int, *, store: MemoryStore, clock: ManualClock) -> list[Replica]:
    out = []
    for i in range(n):
        view = PeerView(f"{i}", claims={"engine-0": 100.0 * i})
        core = RecordingParticipant(view=view)
        policy = RecordingSink()
        sync = ClusterSync(
            store, core, policy, clock, nodes=lambda: NODES, member_id=f"r{i}", expected_members=n
        )
        out.append(Replica(sync, core, policy))
    return out


async def tick_all(replicas: list[Replica], clock: ManualClock, ticks: int = 1) -> None:
    for _ in range(ticks):
        for r in replicas:
            await r.sync.tick()
        clock.advance(SYNC_PERIOD_S)


async def test_every_replica_sees_the_others_views_and_the_member_count() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    replicas = cluster(3, store=store, clock=clock)
    await tick_all(replicas, clock, 2)
    for i, r in enumerate(replicas):
        assert r.sync.state == "synced"
        assert r.core.members == 3
        assert r.core.peer_views is not None
        assert sorted(v.replica for v in r.core.peer_views) == [f"{j}" for j in range(3) if j != i]


async def test_a_replica_that_stops_beating_is_gone_after_its_ttl() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    a, b, dead = cluster(3, store=store, clock=clock)
    await tick_all([a, b, dead], clock, 2)
    assert a.core.members == 3
    await tick_all([a, b], clock, round((MEMBER_TTL_S - 0.15) / SYNC_PERIOD_S))
    assert a.core.members == 3  # not yet: within its ttl
    await tick_all([a, b], clock, round(0.2 / SYNC_PERIOD_S))
    assert a.core.members == 2 and b.core.members == 2
    # b's view, with its age on the store's clock (one period at most: b ticked first)
    [seen] = a.core.peer_views
    assert 0 <= seen.age_s <= SYNC_PERIOD_S
    assert replace(seen, age_s=0.0) == b.core.view


async def test_a_replica_that_leaves_is_gone_at_the_next_tick() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    a, b = cluster(2, store=store, clock=clock)
    await tick_all([a, b], clock)
    await store.leave("r1")
    await tick_all([a], clock)
    assert a.core.members == 1 and a.core.peer_views == []


async def test_store_down_isolates_with_the_last_member_count_and_recovers() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    replicas = cluster(3, store=store, clock=clock)
    await tick_all(replicas, clock, 2)
    store.available = False
    await tick_all(replicas, clock)
    for r in replicas:
        assert r.sync.state == "isolated"
        assert r.core.isolated == 3
        assert all(r.sync.scrapes(n) for n in NODES)  # nobody's samples arrive
    await tick_all(replicas, clock, 3)
    # One isolation (counted and logged once); the core hears of it at every failed tick,
    # so that the requests of the replicas it no longer hears from age.
    assert [r.sync.stats.isolations_total for r in replicas] == [1, 1, 1]
    assert all(r.core.calls[-4:] == ["isolated"] * 4 for r in replicas)
    store.available = True
    store.wipe()  # and it came back empty
    await tick_all(replicas, clock, 2)
    for r in replicas:
        assert r.sync.state == "synced" and r.core.members == 3 and r.core.isolated is None


async def test_a_replica_that_never_reached_the_store_assumes_the_expected_count() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    store.available = False
    (r,) = cluster(1, store=store, clock=clock)
    r.sync.expected_members = 4
    await r.sync.tick()
    assert r.core.isolated == 4


async def test_each_engine_is_scraped_by_its_owner_and_fed_to_the_others() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    replicas = cluster(3, store=store, clock=clock)
    await tick_all(replicas, clock)  # membership known; nobody has samples yet
    assert all(r.sync.scrapes(n) for r in replicas for n in NODES)
    members = [r.sync.member_id for r in replicas]
    for _ in range(3):  # scrape what each should, then sync
        for r in replicas:
            for node in NODES:
                if owner(node, members) == r.sync.member_id:
                    r.sync.sink.observe(node, NodeSample(0.25, 4096, 2, 0, 0.02, clock.now()))
        await tick_all(replicas, clock)
    for r in replicas:
        mine = {n for n in NODES if owner(n, members) == r.sync.member_id}
        assert {n for n in NODES if r.sync.scrapes(n)} == mine
        fed = {n for n, _ in r.policy.samples}
        assert fed == set(NODES)  # its own scrapes and every peer's

    # no exchange succeeds for STALLED_S (a stalled store, not yet found failed): every
    # replica polls every engine itself, and stops once an exchange succeeds again
    def polled_by_their_owners() -> bool:
        return all(
            {n for n in NODES if r.sync.scrapes(n)}
            == {n for n in NODES if owner(n, members) == r.sync.member_id}
            for r in replicas
        )

    clock.advance(STALLED_S - 2 * SYNC_PERIOD_S)  # the last exchange: a period ago
    assert polled_by_their_owners()
    clock.advance(2 * SYNC_PERIOD_S)
    assert all(r.sync.scrapes(n) for r in replicas for n in NODES)
    await tick_all(replicas, clock, 2)  # the first tick reads views from before the stall
    assert polled_by_their_owners()
    # the owner of an engine dies: its records age out, the others scrape it meanwhile
    dead = replicas[0]
    orphan = next(n for n in NODES if owner(n, members) == dead.sync.member_id)
    survivors = replicas[1:]
    await tick_all(survivors, clock, round(SHARED_FRESH_S / SYNC_PERIOD_S) + 2)
    assert all(r.sync.scrapes(orphan) for r in survivors)


async def test_a_peer_view_that_cannot_be_read_counts_as_a_member_without_a_view() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    (a,) = cluster(1, store=store, clock=clock)
    store.exchange_now("from-the-future", b'{"v": 99}', MEMBER_TTL_S)
    store.exchange_now("garbage", b"\x00not json", MEMBER_TTL_S)
    await a.sync.tick()
    assert a.core.members == 3 and a.core.peer_views == []
    assert publication.decode(b'{"v": 1, "core": {}, "samples": {}, "meta": {}}') is not None


async def test_snapshot_names_members_shards_and_store_health() -> None:
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    replicas = cluster(2, store=store, clock=clock)
    await tick_all(replicas, clock, 2)
    snap = replicas[0].sync.snapshot()
    assert snap["state"] == "synced" and snap["replicas"] == 2 and snap["store"] == "memory"
    assert [m["id"] for m in snap["members"]] == ["r0", "r1"]
    assert sum(len(m["owns"]) for m in snap["members"]) == len(NODES)
    assert snap["sync"]["exchanges_total"] == 2 and snap["sync"]["failures_total"] == 0


def test_a_simulation_drives_replicas_without_an_event_loop() -> None:
    """The two halves of a tick, with the store's latency modelled by the caller."""
    clock = ManualClock(100.0)
    store = MemoryStore(clock)
    replicas = cluster(2, store=store, clock=clock)
    latency = 0.002
    for _ in range(2):
        for r in replicas:
            sent_at = clock.now()
            blob = r.sync.outgoing()
            clock.advance(latency / 2)
            reply = store.exchange_now(r.sync.member_id, blob, MEMBER_TTL_S)
            clock.advance(latency / 2)
            r.sync.incoming(reply, sent_at, clock.now())
    assert [r.core.members for r in replicas] == [2, 2]
    assert replicas[0].sync.link.uncertainty_s == pytest.approx(latency / 2)
    replicas[0].sync.failed("store down")
    assert replicas[0].core.isolated == 2
