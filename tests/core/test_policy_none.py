from __future__ import annotations

import json

import pytest

from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.request import Priority
from kvgate.testing.books import upper_tokens

from .helpers import admit, assert_books_empty, cost, make, sample


def test_none_admits_everything_and_spreads_load() -> None:
    policy, _ = make("none")
    tickets = []
    for i in range(10):
        decision = admit(policy, f"r{i}", cost(), Priority.SHEDDABLE, ("a", "b"))
        assert isinstance(decision, Admit)
        tickets.append(decision.ticket)
    per_node = {n: sum(t.node_id == n for t in tickets) for n in ("a", "b")}
    assert per_node == {"a": 5, "b": 5}
    assert policy.snapshot()["in_flight_requests"] == 10
    for t in tickets:
        policy.release(t, Outcome.DONE)
        policy.release(t, Outcome.DONE)  # idempotent
    assert_books_empty(policy)


def test_none_rejects_only_when_no_candidate() -> None:
    policy, _ = make("none")
    decision = admit(policy, "r", cost(), Priority.STANDARD, ())
    assert isinstance(decision, Reject)
    assert decision.status == 503
    assert decision.retry_after_s >= 1


def test_none_snapshot_shape() -> None:
    policy, clock = make("none")
    policy.observe("a", sample(clock, usage=0.5))
    decision = admit(policy, "r", cost(), Priority.STANDARD, ("a",))
    assert isinstance(decision, Admit)
    snap = policy.snapshot()
    node = snap["nodes"]["a"]
    assert node["fresh"] and node["state"] == "ok" and node["in_flight"] == 1
    assert node["reserved_tokens"] == 216
    assert abs(node["predicted_usage"] - (5000 + 116) / 10_000) < 1e-9  # its prompt, now
    assert upper_tokens(policy, policy.nodes["a"]) == 5000 + 216  # and at its cap
    assert set(snap) == {
        "policy",
        "time",
        "nodes",
        "controller",
        "in_flight_requests",
        "released_tokens_per_s",
        "expected_output",
    }


@pytest.mark.parametrize("name", ["none", "static-qps", "static-concurrency", "seed", "adaptive"])
def test_every_policy_snapshot_is_strict_json_with_the_shared_keys(name: str) -> None:
    policy, clock = make(name)
    policy.add_node("never")
    policy.observe("a", sample(clock, usage=0.95))
    policy.observe("llama", sample(clock, usage=None, capacity=None))
    clock.advance(0.05)
    policy.observe("a", sample(clock, usage=0.95))
    decision = admit(policy, "r", cost(), Priority.CRITICAL, ("a", "llama"))
    text = json.dumps(policy.snapshot(), allow_nan=False)
    snap = json.loads(text)
    assert snap["policy"] == name
    assert "in_flight_tokens" in snap["controller"]
    for node in snap["nodes"].values():
        assert set(node) >= {
            "fresh",
            "age_s",
            "state",
            "sample",
            "reserved_tokens",
            "in_flight",
            "predicted_usage",
            "step_s",
        }
        assert node["state"] in {"ok", "high", "panic", "thrashing", "stale", "unknown"}
    assert snap["nodes"]["never"]["state"] == "unknown"
    assert snap["nodes"]["never"]["sample"] is None and snap["nodes"]["never"]["age_s"] is None
    if isinstance(decision, Admit):
        policy.release(decision.ticket, Outcome.DONE)
    assert_books_empty(policy)
