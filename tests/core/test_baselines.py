"""The comparison baselines behave as labelled (the `seed` one with its flaws on purpose),
and only the simulator, the benchmark and the tests can build one."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

import kvgate
from kvgate.core.admission import Admit, Outcome, Reject
from kvgate.core.policies.baselines import BaselineOptions, build_named
from kvgate.core.request import Priority
from kvgate.core.settings import AdmissionSettings

from .helpers import admit, assert_books_empty, cost, make, sample
from .test_purity import imports

BASELINES = "kvgate.core.policies.baselines"


def test_production_never_builds_a_baseline() -> None:
    """The gateway, the cluster, the configuration and the rest of the core import no
    baseline: only `kvgate.sim`, `kvgate.bench` and `kvgate.testing` may."""
    root = Path(kvgate.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("sim", "bench", "testing") or rel.parts[:3] == (
            "core",
            "policies",
            "baselines",
        ):
            continue
        package = ".".join(("kvgate", *rel.parent.parts))
        found += [
            f"{rel}:{line}"
            for line, name in imports(path.read_text(), package)
            if name == BASELINES or name.startswith(BASELINES + ".")
        ]
    assert not found, found
    # (the check sees such an import, relative or absolute, at any depth)
    probe = "def later():\n    from .baselines import NonePolicy\n"
    assert [n for _, n in imports(probe, "kvgate.core.policies")] == [BASELINES + ".NonePolicy"]


def test_a_benchmark_names_its_policy_and_quotas() -> None:
    with pytest.raises(ValueError, match="no policy is called 'fastest'"):
        build_named("fastest", AdmissionSettings(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qps must be positive"):
        BaselineOptions(qps=0)


def test_round_robin_takes_the_candidates_in_turn_whatever_their_load() -> None:
    policy, clock = make("round-robin")
    policy.observe("a", sample(clock, usage=0.99))
    policy.observe("b", sample(clock, usage=0.10))
    tickets = []
    for i in range(6):
        decision = admit(policy, f"r{i}", cost(), Priority.STANDARD, ("a", "b", "c"))
        assert isinstance(decision, Admit)
        tickets.append(decision.ticket)
    nodes = [t.node_id for t in tickets]
    assert nodes[:3] == nodes[3:] and sorted(nodes[:3]) == ["a", "b", "c"]
    for t in tickets:
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_static_qps_is_a_token_bucket() -> None:
    policy, clock = make("static-qps", static_qps=10, static_burst=5)
    results = [admit(policy, f"r{i}", cost(), Priority.CRITICAL, ("a",)) for i in range(8)]
    assert [isinstance(r, Admit) for r in results] == [True] * 5 + [False] * 3
    reject = results[-1]
    assert isinstance(reject, Reject) and reject.reason == "qps_limit" and reject.status == 429
    assert 1.0 <= reject.retry_after_s <= 1.2
    clock.advance(0.25)  # 2.5 tokens
    results = [admit(policy, f"s{i}", cost(), Priority.CRITICAL, ("a",)) for i in range(3)]
    assert [isinstance(r, Admit) for r in results] == [True, True, False]


def test_static_concurrency_caps_in_flight_and_recovers_on_release() -> None:
    policy, _ = make("static-concurrency", static_concurrency=3)
    tickets = []
    for i in range(3):
        decision = admit(policy, f"r{i}", cost(), Priority.STANDARD, ("a", "b"))
        assert isinstance(decision, Admit)
        tickets.append(decision.ticket)
    over = admit(policy, "x", cost(), Priority.CRITICAL, ("a", "b"))
    assert isinstance(over, Reject) and over.reason == "concurrency_limit"
    policy.release(tickets[0], Outcome.CLIENT_CANCEL)
    policy.release(tickets[0], Outcome.DONE)  # a second release must not free a second slot
    again = admit(policy, "y", cost(), Priority.STANDARD, ("a", "b"))
    assert isinstance(again, Admit)
    assert isinstance(admit(policy, "z", cost(), Priority.STANDARD, ("a", "b")), Reject)
    for t in [*tickets[1:], again.ticket]:
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_seed_averages_nodes_and_ignores_where_requests_go() -> None:
    policy, clock = make("seed")
    policy.observe("hot", sample(clock, usage=0.99))
    policy.observe("cold", sample(clock, usage=0.10))
    clock.advance(0.06)
    nodes = []
    for i in range(10):
        decision = admit(policy, f"r{i}", cost(), Priority.STANDARD, ("hot", "cold"))
        assert isinstance(decision, Admit)  # average 0.545: "healthy"
        nodes.append(decision.ticket.node_id)
    assert nodes.count("hot") == 5  # round-robin into a node at 99 %


def test_seed_judges_a_burst_by_the_previous_tick() -> None:
    policy, clock = make("seed")
    policy.observe("a", sample(clock, usage=0.10))
    clock.advance(0.06)
    assert isinstance(admit(policy, "first", cost(), Priority.STANDARD, ("a",)), Admit)
    clock.advance(0.001)
    policy.observe("a", sample(clock, usage=0.99))  # saturated, but the tick has not come
    burst = [admit(policy, f"r{i}", cost(4000, 4000), Priority.STANDARD, ("a",)) for i in range(50)]
    assert all(isinstance(d, Admit) for d in burst)
    clock.advance(0.05)
    assert isinstance(admit(policy, "late", cost(), Priority.STANDARD, ("a",)), Reject)
    assert policy.snapshot()["controller"]["rejection_rate_percent"] == 100


def test_seed_randomness_is_correlated_and_stale_cluster_passes_half() -> None:
    policy, clock = make("seed")
    policy.observe("a", sample(clock, usage=0.5))
    clock.advance(2.0)  # everything stale: the sketch passes 50 %
    assert policy.snapshot()["controller"]["rejection_rate_percent"] == 50
    same_instant = [admit(policy, f"r{i}", cost(), Priority.STANDARD, ("a",)) for i in range(20)]
    kinds = {type(d) for d in same_instant}
    assert len(kinds) == 1  # all pass or all fail together: nanotime % 100
    admitted = 0
    for i in range(200):
        clock.advance(0.012345679)
        decision = admit(policy, f"s{i}", cost(), Priority.STANDARD, ("never-heard",))
        if isinstance(decision, Admit):
            admitted += 1
            assert decision.ticket.node_id == "never-heard"
            policy.release(decision.ticket, Outcome.DONE)
    assert 60 < admitted < 140


def test_seed_flaps_where_adaptive_does_not() -> None:
    """Usage wandering across the high watermark: the sketch jumps 0 % <-> 10 %+, while
    adaptive keeps admitting standard work (its ceiling is panic) with no margin at all."""
    noise = random.Random(5)
    seed, seed_clock = make("seed")
    adaptive, clock = make("adaptive")
    seed_rates, adaptive_admits, margins = [], [], []
    for i in range(200):
        usage = 0.80 + noise.uniform(-0.01, 0.01)
        seed.observe("a", sample(seed_clock, usage=usage))
        adaptive.observe("a", sample(clock, usage=usage))
        seed_rates.append(seed.snapshot()["controller"]["shed_probability"]["standard"])
        probe = admit(adaptive, f"p{i}", cost(10, 10), Priority.STANDARD)
        adaptive_admits.append(isinstance(probe, Admit))
        if isinstance(probe, Admit):
            adaptive.release(probe.ticket, Outcome.DONE)
        margins.append(adaptive.snapshot()["nodes"]["a"]["margin"])
        seed_clock.advance(0.05)
        clock.advance(0.05)
    seed_flips = sum(1 for x, y in itertools.pairwise(seed_rates) if (x == 0) != (y == 0))
    assert seed_flips > 40
    assert all(adaptive_admits)
    assert set(margins) == {0.0}
