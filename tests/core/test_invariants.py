"""Property tests: every book returns to exactly zero, and the bound never under-counts.

Three books must balance after any sequence of events: the placement policy's holds (per
node and in total), the tenants' leases, and the flow controller's queue (its counts and
token sums per band). The first property drives a policy alone; the second drives the flow
controller the shell holds, with waiters that are admitted, refused, evicted, cancelled or
expire, tenants at their limits and nodes that come, go and fail.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.flow import ArrivalOrder, FlowController, TokenFairness, Waiter
from kvgate.core.flow.queue import WaitState
from kvgate.core.nodes import NodeState
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import Priority, RequestCost
from kvgate.core.settings import QueueSettings
from kvgate.core.signals import NodeSample
from kvgate.core.tenants import TenantLedger, TenantLimits
from kvgate.testing.books import full_reserved_on, upper_tokens

from .helpers import assert_books_empty, assert_flow_empty, make, request

POLICIES = ["none", "static-qps", "static-concurrency", "seed", "adaptive", "adaptive-fixed"]
NODES = ["a", "b", "c"]
TENANTS = ["", "t1", "t2"]
CAPACITY = 10_000

node_ids = st.sampled_from(NODES)

# Kinds of events, repeated to weight them: arrivals dominate, so that nodes fill up and,
# through the flow controller, queues form.
NODE_EVENTS = ["observe"] * 3 + ["failure", "remove", "add", "advance", "advance"]
TICKET_EVENTS = ["first_token"] * 2 + ["tokens"] * 3 + ["release"] * 3 + ["release_again"]
POLICY_EVENTS = ["admit"] * 8 + TICKET_EVENTS + NODE_EVENTS
FLOW_EVENTS = ["submit"] * 8 + ["burst"] * 2 + TICKET_EVENTS + ["cancel", "expire", "dispatch"]
FLOW_EVENTS += NODE_EVENTS


def _events(step_s: float, advance_s: float) -> dict[str, st.SearchStrategy[tuple]]:
    """Each kind of event with its own values. `step_s`: the longest decode step a sample
    reports; `advance_s`: the longest jump of the clock."""
    index = st.integers(0, 50)
    priorities = st.sampled_from(list(Priority))
    candidates = st.lists(node_ids, min_size=1, max_size=3, unique=True)
    table: dict[str, st.SearchStrategy[tuple]] = {
        "admit": st.tuples(
            st.just("admit"),
            st.lists(node_ids, max_size=3, unique=True),
            priorities,
            st.integers(1, 3000),
            st.integers(1, 3000),
            st.booleans(),  # exact_output
        ),
        "submit": st.tuples(
            st.just("submit"),
            candidates,
            priorities,
            st.integers(500, 4000),
            # Short outputs end within a wait bound, so those requests may wait.
            st.one_of(st.integers(1, 40), st.integers(1, 3000)),
            st.sampled_from(["", "", *TENANTS]),
            st.sampled_from([None, 0.0, 0.5, 5.0, 100.0]),  # the client's own bound
        ),
        # Several alike at once: the queue forms behind them.
        "burst": st.tuples(
            st.just("burst"),
            candidates,
            priorities,
            st.integers(1500, 3000),
            st.integers(1, 40),
            st.integers(2, 8),
        ),
        "tokens": st.tuples(st.just("tokens"), index, st.integers(1, 500)),
        "release": st.tuples(st.just("release"), index, st.sampled_from(list(Outcome))),
        "observe": st.tuples(
            st.just("observe"),
            node_ids,
            st.one_of(st.none(), st.floats(0, 1)),
            st.integers(0, 64),
            st.integers(0, 64),
            st.floats(0, step_s),
            # The engine's preemption counter (None: it has none), so that nodes are also
            # planned above their cache (kvgate.core.plan.ceiling).
            st.one_of(st.none(), st.integers(0, 20)),
        ),
        "advance": st.tuples(st.just("advance"), st.floats(0, advance_s)),
        "dispatch": st.tuples(st.just("dispatch")),
    }
    for kind in ("first_token", "release_again", "cancel", "expire"):
        table[kind] = st.tuples(st.just(kind), index)
    for kind in ("failure", "remove", "add"):
        table[kind] = st.tuples(st.just(kind), node_ids)
    return table


POLICY_TABLE = _events(step_s=0.2, advance_s=1.5)
# Decode steps and clock jumps short enough that waits fit their bounds.
FLOW_TABLE = _events(step_s=0.05, advance_s=0.5)


def _draw_event(
    data: st.DataObject, kinds: list[str], table: dict[str, st.SearchStrategy[tuple]]
) -> tuple:
    return data.draw(table[data.draw(st.sampled_from(kinds))])


# A failure's shrinking replays long programs many times: give it the minutes it needs to
# end with a short example instead of pytest-timeout cutting it off.
SHRINK_TIME = pytest.mark.timeout(600)


def _any_policy(name: str, fail_open: bool) -> tuple[BasePolicy, ManualClock]:
    """The policy `name`, with baselines tight enough to refuse within a short program."""
    return make(
        name,
        fail_mode="open" if fail_open else "closed",
        static_concurrency=5,
        static_qps=5,
        static_burst=5,
    )


def _observe(policy: BasePolicy | FlowController, op: tuple, now: float) -> None:
    _, node, usage, running, waiting, latency, preemptions = op
    sample = NodeSample(usage, CAPACITY, running, waiting, latency or None, now, preemptions)
    policy.observe(node, sample)


def _check_refusal(decision: Reject) -> None:
    if decision.status == 400:  # never servable as sent: nothing to retry
        assert decision.retry_after_s == 0
    else:
        assert decision.status in (429, 503) and decision.retry_after_s >= 1


def _check_holds(policy: BasePolicy, live: list[Ticket]) -> None:
    """The policy's books agree with the live tickets, per node and in total."""
    overhead = policy.settings.tuning.reservation_overhead_tokens
    full = {t.key: t.request.cost.total + overhead for t in live}
    assert policy.in_flight_requests == len(live)
    assert policy.in_flight_tokens == sum(full.values())
    for node_id in {*NODES, *(t.node_id for t in live)}:
        on_node = [t for t in live if t.node_id == node_id]
        assert policy.holds.in_flight_on(node_id) == len(on_node)
        assert full_reserved_on(policy, node_id) == sum(full[t.key] for t in on_node)
        assert len(on_node) * overhead <= policy.holds.reserved_on(node_id)
        assert policy.holds.reserved_on(node_id) <= full_reserved_on(policy, node_id)
        assert policy.holds.unreflected_now(node_id) >= 0


def _fresh_peak(policy: BasePolicy, node: NodeState) -> float:
    """The node's planned peak built from its books as they are now, the cache untouched."""
    saved = policy.forecast._envelopes.pop(node.node_id, None)
    try:
        return policy.forecast.envelope(node).peak()
    finally:
        if saved is None:
            policy.forecast._envelopes.pop(node.node_id, None)
        else:
            policy.forecast._envelopes[node.node_id] = saved


def _check_peak(policy: BasePolicy, ticket: Ticket) -> None:
    """An adaptive admission never plans a node's peak past the panic watermark."""
    node = policy.nodes[ticket.node_id]
    if node.cap is None:
        return  # queue-gated: no capacity to plan against
    assert _fresh_peak(policy, node) <= policy.settings.panic_watermark * node.cap + 1e-6


def _ticket_event(policy: BasePolicy | FlowController, op: tuple, tickets: list[Ticket]) -> None:
    kind = op[0]
    ticket = tickets[op[1] % len(tickets)]
    if kind == "first_token":
        policy.on_first_token(ticket)
    elif kind == "tokens":
        policy.on_tokens(ticket, ticket.output_tokens + op[2])
    elif kind == "release":
        policy.release(ticket, op[2])
    else:
        policy.release(ticket, Outcome.DONE)
        policy.release(ticket, Outcome.CLIENT_CANCEL)


def _node_event(policy: BasePolicy | FlowController, op: tuple, clock: ManualClock) -> None:
    kind = op[0]
    if kind == "observe":
        _observe(policy, op, clock.now())
    elif kind == "failure":
        policy.observe_failure(op[1])
    elif kind == "remove":
        policy.remove_node(op[1])
    elif kind == "add":
        policy.add_node(op[1])
    else:
        clock.advance(op[1])


@SHRINK_TIME
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy_name=st.sampled_from(POLICIES),
    fail_open=st.booleans(),
    steps=st.integers(0, 100),
    data=st.data(),
)
def test_holds_and_in_flight_return_to_zero(
    policy_name: str, fail_open: bool, steps: int, data: st.DataObject
) -> None:
    policy, clock = _any_policy(policy_name, fail_open)
    tickets: list[Ticket] = []
    for _ in range(steps):
        op = _draw_event(data, POLICY_EVENTS, POLICY_TABLE)
        kind = op[0]
        if kind == "admit":
            _, candidates, priority, prompt, output, exact = op
            decision = policy.admit(
                request(
                    f"r{len(tickets)}",
                    RequestCost(prompt, output),
                    priority,
                    candidates,
                    model="m",
                    exact_output=exact,
                )
            )
            if isinstance(decision, Admit):
                tickets.append(decision.ticket)
                if policy_name == "adaptive" and not fail_open:
                    _check_peak(policy, decision.ticket)
            else:
                _check_refusal(decision)
        elif kind in ("first_token", "tokens", "release", "release_again"):
            if tickets:
                _ticket_event(policy, op, tickets)
        else:
            _node_event(policy, op, clock)
        _check_holds(policy, [t for t in tickets if not t.released])
        json.dumps(policy.snapshot(), allow_nan=False)  # never raises, whatever the state
    for ticket in tickets:
        policy.release(ticket, Outcome.SHUTDOWN)
    assert_books_empty(policy)


# --- the same books through the flow controller, with waiters -------------------------------

TENANT_LIMITS = {
    "t1": TenantLimits(max_in_flight_tokens=9000, max_in_flight_requests=3),
    "t2": TenantLimits(max_in_flight_requests=1),
}
QUEUE = QueueSettings(
    max_wait_s={"critical": 5.0, "standard": 2.0, "sheddable": 1.0},
    max_waiting={"total": 6, "sheddable": 2},
    max_waiting_tokens={"total": 15_000, "standard": 9_000},
)


class _Books:
    """What the test expects the flow controller to hold, from the answers it gave."""

    def __init__(self, flow: FlowController) -> None:
        self.flow = flow
        self.tickets: list[Ticket] = []
        self.waiters: list[Waiter] = []
        self.notified: dict[int, list[Decision]] = {}

    def answer(self, decision: Decision | Waiter) -> None:
        if isinstance(decision, Waiter):
            assert decision.waiting and decision.decision is None
            self.waiters.append(decision)
            self.notified[id(decision)] = []
            decision.notify = self._notifier(decision)
        elif isinstance(decision, Admit):
            self.admitted(decision.ticket, None)
        else:
            _check_refusal(decision)

    def _notifier(self, waiter: Waiter) -> Callable[[Decision], None]:
        def notify(decision: Decision) -> None:
            calls = self.notified[id(waiter)]
            assert not calls, "a waiter is told its answer exactly once"
            assert waiter.state is not WaitState.WAITING and waiter.decision is decision
            calls.append(decision)
            if isinstance(decision, Admit):
                assert waiter.state is WaitState.ADMITTED
                self.admitted(decision.ticket, waiter)
            else:
                assert waiter.state is WaitState.REFUSED
                _check_refusal(decision)

        return notify

    def admitted(self, ticket: Ticket, waiter: Waiter | None) -> None:
        assert not ticket.released and ticket.key in self.flow._leases
        if waiter is not None:  # it waited no longer than its bound
            assert 0 <= ticket.waited_s < waiter.deadline - waiter.enqueued_at + 1e-9
        if self.flow.policy.name == "adaptive" and self.flow.policy.settings.fail_mode == "closed":
            _check_peak(self.flow.policy, ticket)
        self.tickets.append(ticket)

    def check(self) -> None:
        flow = self.flow
        live = [t for t in self.tickets if not t.released]
        _check_holds(flow.policy, live)
        assert set(flow._leases) == {t.key for t in live}
        for tenant in TENANTS:
            mine = [t for t in live if t.request.tenant == tenant]
            tokens = sum(t.request.cost.total for t in mine)
            assert flow.tenants.held(tenant) == (tokens, len(mine))
            limits = flow.tenants.limits_for(tenant)
            if limits.max_in_flight_tokens is not None:
                assert tokens <= limits.max_in_flight_tokens
            if limits.max_in_flight_requests is not None:
                assert len(mine) <= limits.max_in_flight_requests
        waiting = [w for w in self.waiters if w.waiting]
        for waiter in self.waiters:
            told = self.notified[id(waiter)]
            if waiter.waiting or waiter.state is WaitState.CANCELLED:
                assert waiter.decision is None and not told
            else:
                assert told == [waiter.decision]
        assert flow.waiting == len(waiting) == len(list(flow.queue.waiting()))
        assert flow.queue.tokens == sum(w.tokens for w in waiting)
        snap = flow.queue_snapshot()
        for priority in Priority:
            band = [w for w in waiting if w.request.priority is priority]
            assert snap["bands"][priority.label]["waiting"] == len(band)
            assert snap["bands"][priority.label]["tokens"] == sum(w.tokens for w in band)
            cap = QUEUE.cap(QUEUE.max_waiting, priority.label)
            assert cap is None or len(band) <= cap
        assert len(waiting) <= (QUEUE.cap(QUEUE.max_waiting, "total") or len(waiting))
        json.dumps(flow.snapshot(), allow_nan=False)


@SHRINK_TIME
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy_name=st.sampled_from([*POLICIES, "adaptive", "adaptive", "adaptive"]),
    fail_open=st.booleans(),
    fcfs=st.booleans(),
    strict=st.booleans(),
    steps=st.integers(0, 120),
    data=st.data(),
)
def test_flow_books_return_to_zero_through_waits_cancels_and_expiry(
    policy_name: str, fail_open: bool, fcfs: bool, strict: bool, steps: int, data: st.DataObject
) -> None:
    policy, clock = _any_policy(policy_name, fail_open)
    flow = FlowController(
        policy,
        QUEUE,
        tenants=TenantLedger(limits=TENANT_LIMITS),
        fairness=ArrivalOrder() if fcfs else TokenFairness(),
        strict=strict,
    )
    books = _Books(flow)
    for node in NODES:
        flow.observe(node, NodeSample(0.2, CAPACITY, 1, 0, 0.02, clock.now()))
    for _ in range(steps):
        op = _draw_event(data, FLOW_EVENTS, FLOW_TABLE)
        kind = op[0]
        if kind == "submit":
            _, candidates, priority, prompt, output, tenant, max_wait = op
            rid = f"r{len(books.tickets) + len(books.waiters)}"
            books.answer(
                flow.submit(
                    request(
                        rid,
                        RequestCost(prompt, output),
                        priority,
                        candidates,
                        tenant=tenant,
                        model="m",
                        max_wait_s=max_wait,
                    )
                )
            )
        elif kind == "burst":
            _, candidates, priority, prompt, output, count = op
            for _ in range(count):
                rid = f"r{len(books.tickets) + len(books.waiters)}"
                c = RequestCost(prompt, output)
                books.answer(flow.submit(request(rid, c, priority, candidates, model="m")))
        elif kind == "cancel" and books.waiters:
            waiter = books.waiters[op[1] % len(books.waiters)]
            was = waiter.state
            flow.cancel(waiter)
            if was is WaitState.WAITING:
                assert waiter.state is WaitState.CANCELLED
            else:
                assert waiter.state is was  # a decided waiter stays decided
        elif kind == "expire" and books.waiters:
            waiter = books.waiters[op[1] % len(books.waiters)]
            if waiter.waiting:  # the shell gives up at the waiter's deadline
                clock.set(max(clock.now(), waiter.deadline))
                decided = flow.expire(waiter)
                assert isinstance(decided, Reject) and decided.status == 429
                assert not waiter.waiting
        elif kind == "dispatch":
            flow.dispatch()
        elif kind in ("first_token", "tokens", "release", "release_again"):
            if books.tickets:
                _ticket_event(flow, op, books.tickets)
        elif kind not in ("cancel", "expire"):
            _node_event(flow, op, clock)
        books.check()
    for state in WaitState:  # shows in --hypothesis-show-statistics: the paths are exercised
        if any(w.state is state for w in books.waiters):
            event(f"a waiter ended {state.value}")
    for waiter in books.waiters:
        flow.cancel(waiter)
    books.check()
    for ticket in books.tickets:
        flow.release(ticket, Outcome.SHUTDOWN)
    books.check()
    assert_flow_empty(flow)


# --- never under-count: a toy engine that reports the truth ------------------------------

ENGINE_EVENTS = ["admit"] * 3 + ["prefill"] * 2 + ["decode"] * 3 + ["finish", "sample", "sample"]
ENGINE_EVENTS += ["capture", "deliver", "advance", "tick"]


ENGINE_TABLE: dict[str, st.SearchStrategy[tuple]] = {
    "admit": st.tuples(
        st.just("admit"), st.integers(1, 2000), st.integers(1, 2000), st.floats(0.5, 1)
    ),
    "prefill": st.tuples(st.just("prefill"), st.integers(0, 50)),
    "finish": st.tuples(st.just("finish"), st.integers(0, 50)),
    "decode": st.tuples(st.just("decode"), st.integers(0, 50), st.integers(1, 300)),
    "advance": st.tuples(st.just("advance"), st.floats(0, 0.2)),
    "tick": st.tuples(st.just("tick"), st.floats(0, 0.2)),
    **{kind: st.tuples(st.just(kind)) for kind in ("sample", "capture", "deliver")},
}


@SHRINK_TIME
@settings(max_examples=150, deadline=None)
@given(steps=st.integers(0, 120), external=st.integers(0, 20_000), data=st.data())
def test_the_bound_never_undercounts_the_coming_peak(
    steps: int, external: int, data: st.DataObject
) -> None:
    """`bound` (used + every hold at its cap) >= what the live requests will hold at their
    peak (plus other load), and `now` >= what the engine holds at this moment.

    The engine here counts a request's true prompt (at most the estimate) once prefilled,
    plus its generated tokens; its gauge lags by `lag` (less than `reflect_margin_s`) and
    a page may be delivered late. Prefix sharing and preemption are outside this model
    (see `kvgate.core.plan.holds`).
    """
    lag = 0.04
    capacity = 100_000
    policy, clock = make("adaptive", reservation_overhead_tokens=0)
    state: dict[int, dict] = {}
    tickets: list[Ticket] = []

    def engine_used() -> int:
        return external + sum(
            s["prompt"] + s["out"] for s in state.values() if s["prefilled"] and not s["done"]
        )

    history: list[tuple[float, int]] = [(clock.now(), external)]

    def used_as_of(when: float) -> int:
        return next((u for t, u in reversed(history) if t <= when), external)

    def report(used: int | None = None, at: float | None = None) -> None:
        used = used_as_of(clock.now() - lag) if used is None else used
        at = clock.now() if at is None else at
        policy.observe("a", NodeSample(used / capacity, capacity, 1, 0, None, at))

    captured: tuple[int, float] | None = None

    report()
    for _ in range(steps):
        op = _draw_event(data, ENGINE_EVENTS, ENGINE_TABLE)
        kind = op[0]
        live = [i for i, s in state.items() if not s["done"]]
        if kind == "admit":
            _, prompt, output, accuracy = op
            decision = policy.admit(
                request(f"r{len(tickets)}", RequestCost(prompt, output), Priority.CRITICAL)
            )
            if isinstance(decision, Admit):
                state[len(tickets)] = {
                    "prompt": int(prompt * accuracy),
                    "max": output,
                    "out": 0,
                    "prefilled": False,
                    "done": False,
                }
                tickets.append(decision.ticket)
        elif kind == "prefill" and live:
            i = live[op[1] % len(live)]
            if not state[i]["prefilled"]:
                state[i]["prefilled"] = True
                policy.on_first_token(tickets[i])
        elif kind == "decode" and live:
            i = live[op[1] % len(live)]
            s = state[i]
            if s["prefilled"]:
                s["out"] = min(s["max"], s["out"] + op[2])
                policy.on_tokens(tickets[i], s["out"])
        elif kind == "finish" and live:
            i = live[op[1] % len(live)]
            state[i]["done"] = True
            policy.release(tickets[i], Outcome.DONE)
        elif kind == "sample":
            report()
        elif kind == "capture":  # a scrape sent now, its page delivered later
            captured = (used_as_of(clock.now() - lag), clock.now())
        elif kind == "deliver" and captured is not None:
            report(*captured)
            captured = None
        elif kind == "advance":
            clock.advance(op[1])
            report()
        elif kind == "tick":
            clock.advance(op[1])
        history.append((clock.now(), engine_used()))
        peak = external + sum(s["prompt"] + s["max"] for s in state.values() if not s["done"])
        node = policy.nodes["a"]
        bound = upper_tokens(policy, node)
        now = policy.forecast.now_tokens(node)
        assert bound is not None and now is not None
        assert bound >= peak - 1e-6
        assert now >= engine_used() - 1e-6


any_float = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=150, deadline=None)
@example(  # the largest float as a step: the engine's pace overflowed to inf
    policy_name="none", usage=None, capacity=None, running=0, waiting=0,
    latency=1.7976931348623157e308, skew=0.0,
)  # fmt: skip
@given(
    policy_name=st.sampled_from(POLICIES),
    usage=st.one_of(st.none(), any_float),
    capacity=st.one_of(st.none(), st.integers(-10, 10**9)),
    running=st.integers(-5, 10**6),
    waiting=st.integers(-5, 10**6),
    latency=st.one_of(st.none(), any_float),
    skew=any_float,
)
def test_garbage_samples_never_crash_or_poison_the_snapshot(
    policy_name: str,
    usage: float | None,
    capacity: int | None,
    running: int,
    waiting: int,
    latency: float | None,
    skew: float,
) -> None:
    policy, clock = make(policy_name)
    flow = FlowController(policy)
    at = clock.now() + skew
    flow.observe("a", NodeSample(usage, capacity, running, waiting, latency, at))
    decision = flow.submit(request("r", RequestCost(100, 100), Priority.CRITICAL))
    json.dumps(flow.snapshot(), allow_nan=False)
    node = flow.snapshot()["nodes"]["a"]
    assert node["age_s"] is None or node["age_s"] >= 0
    if isinstance(decision, Admit):
        flow.release(decision.ticket, Outcome.DONE)
    elif isinstance(decision, Waiter):
        flow.cancel(decision)
    clock.advance(policy.settings.stale_after_s + 0.01)
    assert not flow.snapshot()["nodes"]["a"]["fresh"]  # a future stamp buys no freshness
    assert_flow_empty(flow)
