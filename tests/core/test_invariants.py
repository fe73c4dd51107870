"""Property tests: books return to exactly zero, and predicted usage never under-counts."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Outcome, Ticket
from kvgate.core.request import Priority, RequestCost
from kvgate.core.signals import NodeSample

from .helpers import assert_books_empty, make

POLICIES = ["none", "static-qps", "static-concurrency", "seed", "adaptive"]
NODES = ["a", "b", "c"]

node_ids = st.sampled_from(NODES)
ops = st.one_of(
    st.tuples(
        st.just("admit"),
        st.lists(node_ids, min_size=0, max_size=3, unique=True),
        st.sampled_from(list(Priority)),
        st.integers(1, 3000),
        st.integers(1, 3000),
    ),
    st.tuples(st.just("first_token"), st.integers(0, 50)),
    st.tuples(st.just("tokens"), st.integers(0, 50), st.integers(1, 500)),
    st.tuples(st.just("release"), st.integers(0, 50), st.sampled_from(list(Outcome))),
    st.tuples(st.just("release_again"), st.integers(0, 50)),
    st.tuples(
        st.just("observe"),
        node_ids,
        st.one_of(st.none(), st.floats(0, 1)),
        st.integers(0, 64),
        st.integers(0, 64),
        st.floats(0, 0.2),
    ),
    st.tuples(st.just("failure"), node_ids),
    st.tuples(st.just("remove"), node_ids),
    st.tuples(st.just("add"), node_ids),
    st.tuples(st.just("advance"), st.floats(0, 1.5)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy_name=st.sampled_from(POLICIES),
    fail_open=st.booleans(),
    program=st.lists(ops, max_size=80),
)
def test_reservations_and_in_flight_return_to_zero(
    policy_name: str, fail_open: bool, program: list[tuple]
) -> None:
    policy, clock = make(
        policy_name,
        fail_mode="open" if fail_open else "closed",
        static_concurrency=5,
        static_qps=5,
        static_burst=5,
    )
    tickets: list[Ticket] = []
    panic = policy.settings.panic_watermark
    for op in program:
        kind = op[0]
        if kind == "admit":
            _, candidates, priority, prompt, output = op
            decision = policy.admit(
                f"r{len(tickets)}", RequestCost(prompt, output), priority, candidates
            )
            if isinstance(decision, Admit):
                tickets.append(decision.ticket)
                if policy_name == "adaptive" and not fail_open:
                    node = policy.nodes[decision.ticket.node_id]
                    assert policy.predicted_usage(node) <= panic + 1e-9
            else:
                assert decision.status in (429, 503) and decision.retry_after_s >= 1
        elif kind in ("first_token", "tokens", "release", "release_again") and tickets:
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
        elif kind == "observe":
            _, node, usage, running, waiting, latency = op
            policy.observe(
                node,
                NodeSample(usage, 10_000, running, waiting, latency or None, clock.now()),
            )
        elif kind == "failure":
            policy.observe_failure(op[1])
        elif kind == "remove":
            policy.remove_node(op[1])
        elif kind == "add":
            policy.add_node(op[1])
        elif kind == "advance":
            clock.advance(op[1])
        live = [t for t in tickets if not t.released]
        assert policy.in_flight_requests == len(live) == policy.store.total_count()
        assert policy.in_flight_tokens == sum(policy.reservation_for(t.cost) for t in live)
        assert 0 <= policy.store.total_reserved() <= policy.in_flight_tokens
        policy.snapshot()  # never raises, whatever the state
    for ticket in tickets:
        policy.release(ticket, Outcome.SHUTDOWN)
    assert_books_empty(policy)


# --- never under-count: a toy engine that reports the truth ------------------------------

engine_ops = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 2000), st.integers(1, 2000), st.floats(0.5, 1)),
    st.tuples(st.just("prefill"), st.integers(0, 50)),
    st.tuples(st.just("decode"), st.integers(0, 50), st.integers(1, 300)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(
        st.just("sample"),
    ),
    st.tuples(st.just("advance"), st.floats(0, 0.2)),
    st.tuples(st.just("tick"), st.floats(0, 0.2)),
)


@settings(max_examples=150, deadline=None)
@given(program=st.lists(engine_ops, max_size=120), external=st.integers(0, 20_000))
def test_predicted_usage_never_undercounts_the_coming_peak(
    program: list[tuple], external: int
) -> None:
    """Predicted tokens >= what the live requests will hold at their peak (plus other load).

    The engine here counts a request's true prompt (at most the estimate) once prefilled,
    plus its generated tokens; its gauge lags by `lag` (less than `reflect_margin_s`) and
    a page may be delivered late. Prefix sharing and preemption are outside this model
    (see `policies.base`).
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
    for op in program:
        kind = op[0]
        live = [i for i, s in state.items() if not s["done"]]
        if kind == "admit":
            _, prompt, output, accuracy = op
            decision = policy.admit(
                f"r{len(tickets)}", RequestCost(prompt, output), Priority.CRITICAL, ["a"]
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
        assert policy.predicted_tokens(node) >= peak - 1e-6


any_float = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=150, deadline=None)
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
    at = clock.now() + skew
    policy.observe("a", NodeSample(usage, capacity, running, waiting, latency, at))
    decision = policy.admit("r", RequestCost(100, 100), Priority.CRITICAL, ["a"])
    json.dumps(policy.snapshot(), allow_nan=False)
    node = policy.snapshot()["nodes"]["a"]
    assert node["age_s"] is None or node["age_s"] >= 0
    if isinstance(decision, Admit):
        policy.release(decision.ticket, Outcome.DONE)
    clock.advance(policy.settings.stale_after_s + 0.01)
    assert not policy.snapshot()["nodes"]["a"]["fresh"]  # a future stamp buys no freshness
    assert_books_empty(policy)
