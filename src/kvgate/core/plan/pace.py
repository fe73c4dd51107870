"""The pace of each node: how many seconds a request running there takes per output token.

The forecast turns steps into seconds with it (`kvgate.core.plan.forecast`): when a running
request will end, when a waiter could start. It is what the node shows, never slower than
the engine's own figure, and a prior only when nothing was measured:

- the node's own streams (the checkpoints of `kvgate.core.plan.holds`), once `_PACE_MIN`
  measurements were taken: an EWMA over `PACE_HALFLIFE_S`, so that the prefill steps that
  interrupt decoding count at their share of time, where a sample's latency spikes with a
  long prompt's prefill;
- the inter-token latency the engine reports (`NodeState.step_s`: the mean over its recent
  samples, each weighing as many intervals as it rests on; a first sample brings the mean
  of the engine's whole history): the pace is the lower of the two. A stream's events can
  count fewer tokens than the engine made (an engine that merges the tokens of a lagging
  stream into one event: vLLM's under load), so the streams alone would predict waits
  several times too long;
- the streams' first measurements, fewer than `_PACE_MIN`, when the engine reports none;
- `DEFAULT_STEP_S`, when nothing was measured at all (a fresh engine that never made a
  token). A prediction on that prior is not a measurement (`measured`): the flow
  controller queues a request on it rather than refuse it (`kvgate.core.flow`).

A refusal is judged at the node's *fastest* pace (`fastest_step_s`): the least of the
above, its healthy latency baseline, and the least window mean the engine showed in the
last `STEP_FLOOR_SPAN_S` while no prompt kvgate sent it was waiting for its first token
(`NodeState.step_floor_s`: its decode step between two prefills). The engine's figure is
a measurement only with such a window in that span (in a burst of 32 prompts of 1,200
tokens that the engine served in 28 s, a fresh gateway refused one after it had waited
1 s: the windows of a burst's first second are its prompts' prefills), and only from its
`ENGINE_WINDOWS_MIN`-th window on:
the first windows of a burst hold its prompts' prefills, which stall every request that
decodes (on a slow CPU engine, 5 prompts of 500 tokens admitted one after another made the
first window's mean 1.2 s per token, the next ones' 0.03-0.05 s: judged on the first, 11
of a 16-request burst served in 15 s were refused as 75-150 s away).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.core.nodes import NodeState
from kvgate.core.rates import Ewma

# How fast requests progress on a node is measured over this half-life: long enough that a
# long prompt's prefill, which slows every decode for seconds, counts at its share of time.
PACE_HALFLIFE_S = 10.0
_PACE_MIN = 8  # stream measurements before they may lower the engine's own figure
# The engine's windows with tokens in them before its figure is a measurement.
ENGINE_WINDOWS_MIN = 3
# Seconds per token assumed for a node before anything measured it (no stream has run on
# it and its samples report no latency). Predictions made on it are not measurements.
DEFAULT_STEP_S = 0.01


class Pace:
    """Seconds per token of each node's streams, over the policy's `nodes`."""

    __slots__ = ("_nodes", "_paces")

    def __init__(self, nodes: Mapping[str, NodeState]) -> None:
        self._nodes = nodes
        self._paces: dict[str, Ewma] = {}

    def record(self, node_id: str, now: float, seconds_per_token: float) -> None:
        """One measurement of a stream on the node, taken at `now`."""
        pace = self._paces.get(node_id)
        if pace is None:
            pace = self._paces[node_id] = Ewma(PACE_HALFLIFE_S)
        pace.update(now, seconds_per_token)

    def forget(self, node_id: str) -> None:
        self._paces.pop(node_id, None)

    def step_s(self, node_id: str) -> float:
        """Seconds per token of a request running on the node (see the module docstring)."""
        node = self._nodes.get(node_id)
        engine = None if node is None else node.step_s
        if engine is not None and engine <= 0:
            engine = None
        streams = self._paces.get(node_id)
        measured = None if streams is None else streams.value
        if measured is None or measured <= 0 or streams is None:
            return DEFAULT_STEP_S if engine is None else engine
        if engine is None:
            return measured
        return min(measured, engine) if streams.count >= _PACE_MIN else engine

    def measured(self, node_id: str) -> bool:
        """Is the node's pace measured (its streams or its engine), not the prior or the
        first windows of a burst (see the module docstring)?"""
        streams = self._paces.get(node_id)
        if streams is not None and streams.count >= _PACE_MIN:
            return True
        node = self._nodes.get(node_id)
        if node is None or node.step_floor_s is None:  # no decode step seen lately
            return False
        return node.step_mean.windows >= ENGINE_WINDOWS_MIN

    def fastest_step_s(self, node_id: str) -> float:
        """The node's fastest pace: its recent one, its healthy latency baseline, or the
        least window mean its engine showed lately, whichever is lowest."""
        step = self.step_s(node_id)
        node = self._nodes.get(node_id)
        if node is None:
            return step
        baseline = None if node.latency_baseline is None else node.latency_baseline.value
        for other in (baseline, node.step_floor_s):
            if other is not None and 0 < other < step:
                step = other
        return step
