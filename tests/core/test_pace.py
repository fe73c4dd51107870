"""The pace on its own: the lower of the streams' measured seconds per token (once there are
enough) and the engine's reported latency, else the one there is, else the prior (not a
measurement); the healthy baseline when faster."""

from __future__ import annotations

from kvgate.core.nodes import NodeState
from kvgate.core.plan.pace import _PACE_MIN, DEFAULT_STEP_S, Pace
from kvgate.core.rates import Ewma

from .helpers import make, sample


def test_a_node_nobody_measured_runs_at_the_prior_and_says_so() -> None:
    pace = Pace({"a": NodeState("a")})
    assert pace.step_s("a") == DEFAULT_STEP_S == pace.fastest_step_s("a")
    assert not pace.measured("a") and not pace.measured("unknown")


def test_samples_then_streams_decide_the_pace() -> None:
    nodes = {"a": NodeState("a", step_s=0.03)}
    pace = Pace(nodes)
    assert pace.step_s("a") == 0.03 and pace.measured("a")  # the engine's own latency
    for i in range(_PACE_MIN - 1):
        pace.record("a", float(i), 0.02)
    assert pace.step_s("a") == 0.03  # the streams: not yet trusted
    pace.record("a", float(_PACE_MIN), 0.02)
    # Faster than a sample's latency, which a long prompt's prefill inflates for a moment.
    assert abs(pace.step_s("a") - 0.02) < 1e-9
    pace.forget("a")
    assert pace.step_s("a") == 0.03


def test_streams_never_make_the_pace_slower_than_the_engine_reports() -> None:
    """vLLM under load merges a lagging stream's tokens into one event: its streams counted
    an eighth of the tokens, a pace of 38 ms where the engine stepped in 4-5 ms, and a warm
    gateway refused 19 of a 32-request burst the engine served in 20 s."""
    nodes = {"a": NodeState("a", step_s=0.0045)}
    pace = Pace(nodes)
    for i in range(2 * _PACE_MIN):
        pace.record("a", float(i), 0.038)
    assert pace.step_s("a") == 0.0045
    nodes["a"].step_s = None  # an engine that reports no latency: the streams are all there is
    assert abs(pace.step_s("a") - 0.038) < 1e-9


def test_a_first_stream_measurement_beats_the_prior() -> None:
    pace = Pace({"a": NodeState("a")})
    pace.record("a", 1.0, 0.0027)  # the engine steps in 2.7 ms: never predict at 10 ms
    assert pace.step_s("a") == 0.0027 and pace.measured("a")


def test_the_fastest_pace_is_the_healthy_baseline_when_lower() -> None:
    baseline = Ewma(30.0)
    baseline.update(0.0, 0.01)
    nodes = {"a": NodeState("a", step_s=0.04, latency_baseline=baseline)}
    pace = Pace(nodes)
    assert pace.step_s("a") == 0.04 and abs(pace.fastest_step_s("a") - 0.01) < 1e-12
    nodes["a"].step_s = 0.005  # faster than its baseline now: the recent pace stands
    assert pace.fastest_step_s("a") == 0.005


def test_admin_state_shows_each_nodes_pace_and_whether_it_is_measured() -> None:
    policy, clock = make()
    policy.observe("a", sample(clock, usage=0.0, capacity=4096, latency=None))
    policy.observe("b", sample(clock, usage=0.0, capacity=4096, latency=0.0027))
    nodes = policy.snapshot()["nodes"]
    assert nodes["a"]["pace_s"] == DEFAULT_STEP_S and nodes["a"]["pace_measured"] is False
    assert nodes["b"]["pace_s"] == 0.0027 and nodes["b"]["pace_measured"] is True
