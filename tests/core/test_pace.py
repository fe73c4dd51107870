"""The pace on its own: the lower of the streams' measured seconds per token (once there are
enough) and the engine's reported latency, else the one there is, else the prior (not a
measurement); the healthy baseline or the engine's least recent window when faster; a
measurement only once enough was seen (a burst's first windows are its prefills), and with
a window that held none of the gateway's prefills (its decode step)."""

from __future__ import annotations

import dataclasses

from kvgate.core.admission import Admit
from kvgate.core.clock import ManualClock
from kvgate.core.nodes import STEP_FLOOR_SPAN_S, NodeState
from kvgate.core.plan.pace import _PACE_MIN, DEFAULT_STEP_S, ENGINE_WINDOWS_MIN, Pace
from kvgate.core.rates import Ewma
from kvgate.core.request import AdmissionRequest, RequestCost
from kvgate.core.settings import AdmissionSettings

from .helpers import make, sample


def engine(
    node: NodeState,
    clock: ManualClock,
    latency: float,
    tokens: float | None = None,
    decoding: bool = True,
) -> None:
    """One scrape of the node whose window shows `latency` s per token over `tokens`;
    `decoding`: no prompt the gateway sent it waits for its first token."""
    window = dataclasses.replace(sample(clock, latency=latency), iteration_tokens=tokens)
    assert node.accept(window, clock.now(), AdmissionSettings(), decoding)
    clock.advance(0.1)


def watched(step_s: float, windows: int = ENGINE_WINDOWS_MIN) -> NodeState:
    """A node whose engine reported `step_s` in each of `windows` scrapes."""
    node, clock = NodeState("a"), ManualClock(0.0)
    for _ in range(windows):
        engine(node, clock, step_s)
    return node


def test_a_node_nobody_measured_runs_at_the_prior_and_says_so() -> None:
    pace = Pace({"a": NodeState("a")})
    assert pace.step_s("a") == DEFAULT_STEP_S == pace.fastest_step_s("a")
    assert not pace.measured("a") and not pace.measured("unknown")


def test_samples_then_streams_decide_the_pace() -> None:
    nodes = {"a": watched(0.03)}
    pace = Pace(nodes)
    assert abs(pace.step_s("a") - 0.03) < 1e-12 and pace.measured("a")  # the engine's own
    for i in range(_PACE_MIN - 1):
        pace.record("a", float(i), 0.02)
    assert abs(pace.step_s("a") - 0.03) < 1e-12  # the streams: not yet trusted
    pace.record("a", float(_PACE_MIN), 0.02)
    # Faster than a sample's latency, which a long prompt's prefill inflates for a moment.
    assert abs(pace.step_s("a") - 0.02) < 1e-9
    pace.forget("a")
    assert abs(pace.step_s("a") - 0.03) < 1e-12


def test_streams_never_make_the_pace_slower_than_the_engine_reports() -> None:
    """vLLM under load merges a lagging stream's tokens into one event: its streams counted
    an eighth of the tokens, a pace of 38 ms where the engine stepped in 4-5 ms, and a warm
    gateway refused 19 of a 32-request burst the engine served in 20 s."""
    nodes = {"a": watched(0.0045)}
    pace = Pace(nodes)
    for i in range(2 * _PACE_MIN):
        pace.record("a", float(i), 0.038)
    assert abs(pace.step_s("a") - 0.0045) < 1e-12
    nodes["a"].step_s = None  # an engine that reports no latency: the streams are all there is
    assert abs(pace.step_s("a") - 0.038) < 1e-9


def test_a_first_stream_measurement_beats_the_prior() -> None:
    pace = Pace({"a": NodeState("a")})
    pace.record("a", 1.0, 0.0027)  # the engine steps in 2.7 ms: never predict at 10 ms
    assert pace.step_s("a") == 0.0027
    assert not pace.measured("a")  # nothing is refused on it yet
    for i in range(_PACE_MIN - 1):
        pace.record("a", 2.0 + i, 0.0027)
    assert pace.measured("a")


def test_a_bursts_first_windows_are_not_its_pace() -> None:
    """On a slow CPU engine, 5 prompts of 500 tokens admitted one after another stalled
    every decode: the first window's mean was 1.2 s per token, the next ones' 0.03-0.05 s.
    Judged on the first, 11 of a 16-request burst served in 15 s were refused as 75-150 s
    away. Each window weighs as many intervals as it rests on, a refusal is judged at the
    least recent window, and nothing is a measurement before the third window."""
    node, clock = NodeState("a"), ManualClock(0.0)
    pace = Pace({"a": node})
    engine(node, clock, 1.2, tokens=5)
    assert not pace.measured("a") and pace.fastest_step_s("a") == 1.2
    engine(node, clock, 0.04, tokens=30)
    assert not pace.measured("a")
    assert abs(pace.step_s("a") - (5 * 1.2 + 30 * 0.04) / 35) < 0.01  # its share of intervals
    assert pace.fastest_step_s("a") == 0.04  # the decode step itself
    engine(node, clock, 0.03, tokens=30)
    assert pace.measured("a") and pace.fastest_step_s("a") == 0.03
    for _ in range(100):  # 10 s of decoding at 0.03 s: the prefill's share fades
        engine(node, clock, 0.03, tokens=30)
    assert pace.step_s("a") < 0.035
    clock.advance(11.0)
    engine(node, clock, 0.5, tokens=1)  # the decode windows left the floor's span
    assert node.step_floor_s == 0.5 and pace.fastest_step_s("a") == pace.step_s("a") < 0.5


def test_windows_that_hold_the_gateways_prefills_are_no_decode_step() -> None:
    """A burst of 1,100-token prompts on a fresh engine: for its first second every window
    holds prefills the gateway sent (0.2-0.4 s per token). They enter the node's likely
    pace at their share, never its floor: nothing is refused on them. The first window
    that begins and ends with every prompt started is the decode step, a measurement."""
    node, clock = NodeState("a"), ManualClock(0.0)
    pace = Pace({"a": node})
    for latency in (0.4, 0.3, 0.2, 0.25, 0.3):
        engine(node, clock, latency, tokens=12, decoding=False)
    assert node.step_floor_s is None and not pace.measured("a")
    engine(node, clock, 0.2, tokens=12)  # the last first token came within this window
    assert node.step_floor_s is None and not pace.measured("a")
    engine(node, clock, 0.03, tokens=24)
    assert node.step_floor_s == 0.03 and pace.measured("a")
    assert pace.fastest_step_s("a") == 0.03 < pace.step_s("a")


def test_a_policy_tells_its_nodes_which_windows_held_its_prefills() -> None:
    """Through the policy: while a request it admitted waits for its first token, the
    node's windows make no floor; once it streamed, they do."""
    policy, clock = make()
    for _ in range(ENGINE_WINDOWS_MIN):
        policy.observe("a", sample(clock, usage=0.1, capacity=4096, latency=0.01))
        clock.advance(0.1)
    node = policy.nodes["a"]
    floor = node.step_floor_s
    assert floor == 0.01
    decision = policy.admit(AdmissionRequest("r", RequestCost(1000, 100), candidates=("a",)))
    assert isinstance(decision, Admit)
    clock.advance(STEP_FLOOR_SPAN_S + 0.1)  # the decode windows leave the floor's span
    for _ in range(3):
        policy.observe("a", sample(clock, usage=0.3, capacity=4096, latency=0.3))
        clock.advance(0.1)
    assert node.step_floor_s is None
    policy.on_first_token(decision.ticket)
    for _ in range(2):
        policy.observe("a", sample(clock, usage=0.3, capacity=4096, latency=0.02))
        clock.advance(0.1)
    assert node.step_floor_s == 0.02


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
    for _ in range(ENGINE_WINDOWS_MIN):
        policy.observe("b", sample(clock, usage=0.0, capacity=4096, latency=0.0027))
        clock.advance(0.1)
    nodes = policy.snapshot()["nodes"]
    assert nodes["a"]["pace_s"] == DEFAULT_STEP_S and nodes["a"]["pace_measured"] is False
    assert abs(nodes["b"]["pace_s"] - 0.0027) < 1e-12 and nodes["b"]["pace_measured"] is True
    assert abs(nodes["b"]["pace_fastest_s"] - 0.0027) < 1e-12
