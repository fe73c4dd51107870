"""A request the engine freed before the last sample was taken is not freed a second
time when the gateway reads its end.

A released hold leaves the plan at once, and the sample it may or may not be in is taken
as it is: a sample taken after the engine freed the request no longer holds it, and
nothing is subtracted from it again (`benchmarks/replicas/live.py` saw one gateway reach
KV 0.98 and preempt when ended requests were subtracted from such a sample).
"""

from __future__ import annotations

from kvgate.core.admission import Admit, Outcome
from kvgate.core.clock import ManualClock
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.policies import build_policy
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

CAPACITY = 4096  # the panic ceiling (0.92) is 3,768 tokens


def test_a_request_freed_before_the_last_sample_is_not_freed_twice() -> None:
    clock = ManualClock(10.0)
    flow = FlowController(build_policy(AdmissionSettings(), clock, rng_seed=0))
    flow.add_node("a")

    def sample(used: int) -> None:
        flow.observe("a", NodeSample(used / CAPACITY, CAPACITY, 0, 0, 0.01, clock.now()))

    def request(rid: str, wait: float = 0) -> AdmissionRequest:
        return AdmissionRequest(
            rid, RequestCost(800, 300), model="m", candidates=("a",), exact_output=True,
            max_wait_s=wait,
        )  # fmt: skip

    sample(0)
    tickets = []
    for i in range(3):  # three requests of 800 + 300 tokens: a fourth would not fit
        decision = flow.submit(request(f"r{i}"))
        assert isinstance(decision, Admit)
        tickets.append(decision.ticket)
        clock.advance(0.01)
    for ticket in tickets:
        flow.on_first_token(ticket)
    # r0 runs to its end, r1 and r2 to half their output; the engine's samples show it.
    for step in range(1, 301):
        clock.advance(0.01)
        flow.on_tokens(tickets[0], step)
        flow.on_tokens(tickets[1], min(step, 150))
        flow.on_tokens(tickets[2], min(step, 150))
        if step % 5 == 0:
            sample(1100 + 2 * 950)
    # The engine frees r0; a sample taken now no longer holds it; then the gateway reads
    # r0's end and releases it.
    clock.advance(0.005)
    sample(2 * 950)
    clock.advance(0.005)
    flow.release(tickets[0], Outcome.DONE)
    # The sample no longer holds r0, or it may: until the next one says, r0's blocks count
    # at this instant and end now. Room after r1 and r2's end: 3,768 - 2 x 1,100 = 1,568
    # tokens, so one newcomer of 1,116 fits once a sample confirms r0 gone, and a second
    # would take the engine to 4,132 of its 4,096 tokens (a preemption): never both.
    first = flow.submit(request("n0", wait=1.0))
    second = flow.submit(request("n1"))
    assert not isinstance(second, Admit)
    clock.advance(0.05)
    sample(2 * 1000)
    decision = first.decision if isinstance(first, Waiter) else first
    assert isinstance(decision, Admit)
    assert not isinstance(flow.submit(request("n2")), Admit)
