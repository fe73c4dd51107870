"""Replicas racing for the same room, tick by tick on a manual clock: the real flow
controllers, linked by the real sync task (`ClusterSync`) through the in-process store.

Unlike a sync that hands every replica the same views at the same instant, each replica
here ticks at its own phase, as live replicas do: it publishes its view, reads the others'
latest ones (written at their own last tick) and then admits with its share. These tests
reproduce what the live tests (`test_live_admission.py`) see with real processes.
"""

from __future__ import annotations

import bench_scripts

from kvgate.cluster.store import MemoryStore
from kvgate.cluster.sync import SYNC_PERIOD_S, ClusterSync
from kvgate.core.admission import Admit, Decision
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import TenantLedger, TenantLimits

CAPACITY = 4096  # the panic ceiling (0.92) leaves 3,768 tokens: one request of 3,016 fits


class Cluster:
    """`n` replicas on one store; replica i ticks at `phases[i]` within each period."""

    def __init__(self, n: int, phases: list[float], limits: dict[str, TenantLimits]) -> None:
        self.clock = ManualClock(100.0)
        self.store = MemoryStore(self.clock)
        self.phases = phases
        self.flows: list[FlowController] = []
        self.syncs: list[ClusterSync] = []
        for i in range(n):
            policy = build_policy(AdmissionSettings(), self.clock, rng_seed=i)
            flow = FlowController(policy, tenants=TenantLedger(limits=limits), replica=f"r{i}")
            flow.add_node("a")
            sync = ClusterSync(
                self.store, flow, flow, self.clock, nodes=lambda: ["a"], member_id=f"r{i}"
            )
            self.flows.append(flow)
            self.syncs.append(sync)
        self.sample()

    def sample(self) -> None:
        for flow in self.flows:
            flow.observe("a", NodeSample(0.0, CAPACITY, 0, 0, 0.01, self.clock.now()))

    async def run(self, periods: int, arrivals: list[tuple[float, int, AdmissionRequest]]) -> None:
        """Tick every replica at its phase for `periods` periods; each arrival (time from
        now, replica, request) is submitted at its time. Decisions land in `self.answers`."""
        start = self.clock.now()
        events = [(start + k * SYNC_PERIOD_S + p, 0, i) for k in range(periods) for i, p in
                  enumerate(self.phases)]  # fmt: skip
        events += [(start + at, 1, j) for j, (at, _, _) in enumerate(arrivals)]
        self.answers: list[Decision | Waiter] = []
        for at, kind, index in sorted(events):
            self.clock.advance(max(0.0, at - self.clock.now()))
            if kind == 0:
                assert await self.syncs[index].tick()
            else:
                _, replica, request = arrivals[index]
                self.answers.append(self.flows[replica].submit(request))

    def started(self) -> int:
        return sum(
            isinstance(a, Admit) or (isinstance(a, Waiter) and isinstance(a.decision, Admit))
            for a in self.answers
        )


def request(rid: str, prompt: int, output: int, tenant: str = "") -> AdmissionRequest:
    return AdmissionRequest(
        rid, RequestCost(prompt, output), tenant=tenant, model="m", candidates=("a",),
        exact_output=True,
    )  # fmt: skip


async def test_two_replicas_ticking_at_their_own_phases_never_both_take_the_last_room() -> None:
    cluster = Cluster(2, phases=[0.0, 0.02], limits={})
    await cluster.run(2, [])  # both have exchanged views with nothing held
    # Each request needs 3,016 of the 3,768 tokens; they arrive at the same moment.
    arrivals = [(0.001, 0, request("x", 2000, 1000)), (0.001, 1, request("y", 2000, 1000))]
    await cluster.run(4, arrivals)
    assert all(isinstance(a, Waiter) for a in cluster.answers)  # each had half the room
    assert cluster.started() == 1
    assert sum(f.policy.in_flight_requests for f in cluster.flows) == 1


async def test_a_tenant_limit_holds_across_three_replicas_ticking_at_their_own_phases() -> None:
    limit = 4
    cluster = Cluster(
        3, phases=[0.0, 0.015, 0.035], limits={"t": TenantLimits(max_in_flight_requests=limit)}
    )
    await cluster.run(2, [])
    # Ten requests of the tenant at each replica within 30 ms.
    arrivals = [
        (0.003 * k, i, request(f"{i}-{k}", 10, 10, tenant="t")) for k in range(10) for i in range(3)
    ]
    await cluster.run(6, arrivals)
    held = sum(f.tenants.held("t")[1] for f in cluster.flows)
    assert held == cluster.started()
    assert held == limit  # the limit is reached, and never passed


def test_shared_replicas_never_preempt_small_engines_in_virtual_time() -> None:
    """The replica benchmark's small-engine burst (`benchmarks/replicas/virtual.py`, the
    live benchmark's burst: four cpu-tiny engines, 2 s at 20 requests/s then 6 s at
    3.3/s, ~800-token prompts, 300 output tokens) through two replicas syncing every 50 ms
    in one atomic exchange, as live replicas do."""
    result = bench_scripts.load("replicas/virtual.py").run("cpu-tiny", 2, True, 1)
    assert result["preemptions"] == 0


async def test_requests_queue_behind_a_waiter_when_the_room_is_held_by_another_replica() -> None:
    """One gateway queues a burst it has no room for; two replicas must queue it too when
    the room is held by the other one (the real engine's burst through two replicas got
    10 refusals of 16: `tests/real_engine/test_real_replicas.py`)."""
    cluster = Cluster(2, phases=[0.0, 0.0], limits={})
    b = cluster.flows[1]
    await cluster.run(2, [])
    # Replica a fills the engine (5 requests of 636 tokens: a sixth would pass 3,768).
    fill = [(0.01 * i, 0, request(f"f{i}", 500, 120)) for i in range(5)]
    await cluster.run(8, fill)
    assert cluster.started() == 5
    more = [b.submit(request(f"m{i}", 500, 120)) for i in range(3)]
    assert all(isinstance(x, Waiter) for x in more), [getattr(x, "reason", x) for x in more]


async def test_requests_larger_than_the_replicas_claim_wait_for_the_next_sync() -> None:
    """Each replica may add about half of the room before its next sync; a request larger
    than that waits for the sync that gives it its room (not `wait_exceeded` at arrival,
    as the second of a burst was when nothing ran yet to predict its wait from)."""
    cluster = Cluster(2, phases=[0.0, 0.025], limits={})
    await cluster.run(2, [])  # the replicas have exchanged views with nothing held
    a = cluster.flows[0]
    allowance = a.policy.claims.allowance("a")
    assert allowance is not None and allowance < 2016 < 3768  # over its part, not the node's
    burst = [(0.001 * k, 0, request(f"big{k}", 1000, 1000)) for k in range(3)]
    await cluster.run(4, burst)
    assert all(isinstance(x, Waiter) for x in cluster.answers), cluster.answers
    first = cluster.answers[0]
    # Its replica's next sync publishes its need; the other replica's next claim is made
    # on the views it read before, the one after yields the room, and this replica's
    # following sync claims it: three sync periods.
    assert isinstance(first, Waiter) and isinstance(first.decision, Admit)
    assert first.decision.ticket.admitted_at - first.enqueued_at <= 3 * SYNC_PERIOD_S + 1e-9
