"""A small deterministic harness for the flow controller: nodes that decode in lockstep.

`Bench` holds a `FlowController` around the adaptive policy on a `ManualClock`, and plays
the engines itself: each admitted request holds its prompt plus what it has generated, every
`step()` adds one token to each running request and ends those that reach their output, and
`sample()` reports each node's true usage. Everything happens in virtual time, so a test
states exactly when room frees and checks who got it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.flow import ArrivalOrder, FlowController, TokenFairness, Waiter
from kvgate.core.plan.pace import ENGINE_WINDOWS_MIN
from kvgate.core.policies import build_policy
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.core.signals import NodeSample
from kvgate.testing.books import ledger_totals

STEP_S = 0.01  # seconds per decode step (what the samples report as iteration latency)


@dataclass
class Running:
    ticket: Ticket
    output: int  # tokens it will generate in all
    produced: int = 0


@dataclass
class Bench:
    capacity: int = 4096
    nodes: tuple[str, ...] = ("a",)
    queue: QueueSettings = field(default_factory=QueueSettings)
    fcfs: bool = False
    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    # Engines with prefix caching: their block size, and the prompt tokens that every
    # request given `prompt_ids` shares (the engine holds them once).
    block_size: int | None = None
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        self.clock = ManualClock(100.0)
        policy = build_policy(self.settings, self.clock, rng_seed=1)
        fairness = ArrivalOrder() if self.fcfs else TokenFairness()
        self.flow = FlowController(policy, self.queue, fairness=fairness, strict=self.fcfs)
        self.running: dict[str, list[Running]] = {n: [] for n in self.nodes}
        self.decisions: dict[str, Decision] = {}
        self.order: list[str] = []  # request ids in the order they started
        self._ids = itertools.count()
        self.steps = 0
        for node in self.nodes:
            self.flow.add_node(node)
        for _ in range(ENGINE_WINDOWS_MIN):  # engines watched long enough to know their pace
            self.sample()

    # --- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt: int,
        output: int,
        *,
        priority: Priority = Priority.STANDARD,
        tenant: str = "",
        name: str | None = None,
        exact: bool = True,
        max_wait_s: float | None = None,
        prompt_ids: tuple[int, ...] | None = None,
        timeout_s: float | None = None,
        answer_timeout_s: float | None = None,
        stream: bool = False,
    ) -> Decision | Waiter:
        rid = name or f"r{next(self._ids)}"
        request = AdmissionRequest(
            rid,
            RequestCost(prompt, output),
            priority,
            tenant=tenant,
            model="m",
            candidates=self.nodes,
            exact_output=exact,
            max_wait_s=max_wait_s,
            timeout_s=timeout_s,
            answer_timeout_s=answer_timeout_s,
            stream=stream,
            prompt_ids=prompt_ids,
        )
        result = self.flow.submit(request)
        if isinstance(result, Waiter):
            result.notify = lambda d, rid=rid, out=output: self._decided(rid, d, out)
        else:
            self._decided(rid, result, output)
        return result

    def _decided(self, rid: str, decision: Decision, output: int) -> None:
        self.decisions[rid] = decision
        if isinstance(decision, Admit):
            ticket = decision.ticket
            self.running[ticket.node_id].append(Running(ticket, output))
            self.order.append(rid)

    def admitted(self, rid: str) -> bool:
        return isinstance(self.decisions.get(rid), Admit)

    def refused(self, rid: str) -> Reject | None:
        decision = self.decisions.get(rid)
        return decision if isinstance(decision, Reject) else None

    # --- engines -------------------------------------------------------------------------------

    def step(self, steps: int = 1, sample_every: int = 5) -> None:
        """Advance `steps` decode steps: each running request makes one token per step."""
        for _ in range(steps):
            self.steps += 1
            self.clock.advance(STEP_S)
            for live in self.running.values():
                for run in list(live):
                    run.produced += 1
                    if run.produced == 1:
                        self.flow.on_first_token(run.ticket)
                    self.flow.on_tokens(run.ticket, run.produced)
                    if run.produced >= run.output:
                        live.remove(run)
                        self.flow.release(run.ticket, Outcome.DONE)
            if self.steps % sample_every == 0:
                self.sample()

    def run_until_idle(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if not any(self.running.values()) and not self.flow.waiting:
                return
            self.step()
        raise AssertionError("the bench never went idle")

    def used(self, node: str) -> int:
        live = self.running[node]
        sharing = sum(1 for r in live if r.ticket.request.prompt_ids)
        held = sum(r.ticket.request.cost.prompt_tokens + r.produced for r in live)
        return held - max(0, sharing - 1) * self.shared_prefix

    def sample(self) -> None:
        for node in self.nodes:
            self.flow.observe(
                node,
                NodeSample(
                    kv_usage=self.used(node) / self.capacity,
                    kv_capacity_tokens=self.capacity,
                    running=len(self.running[node]),
                    waiting=0,
                    iteration_latency_s=STEP_S,
                    sampled_at=self.clock.now(),
                    block_size=self.block_size,
                ),
            )

    def peak_usage(self) -> float:
        return max(self.used(n) for n in self.nodes) / self.capacity

    def books_empty(self) -> bool:
        policy = self.flow.policy
        return (
            policy.in_flight_requests == 0
            and policy.in_flight_tokens == 0
            and self.flow.waiting == 0
            and all(policy.holds.reserved_on(n) == 0 for n in self.nodes)
            and ledger_totals(self.flow.tenants) == (0, 0)
        )
