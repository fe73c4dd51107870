"""The pace of each node: how many seconds a request running there takes per output token.

The forecast turns steps into seconds with it (`kvgate.core.plan.forecast`): when a running
request will end, when a waiter could start. It is measured on the node's own streams (the
checkpoints of `kvgate.core.plan.holds`), as an EWMA over `PACE_HALFLIFE_S` so that the
prefill steps that interrupt decoding count at their share of time; before
`_PACE_MIN` measurements it falls back on the iteration latency the node's samples report,
and before any of those on `DEFAULT_STEP_S`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.core.nodes import NodeState
from kvgate.core.rates import Ewma

# How fast requests progress on a node is measured over this half-life: long enough that a
# long prompt's prefill, which slows every decode for seconds, counts at its share of time.
PACE_HALFLIFE_S = 10.0
_PACE_MIN = 8  # measurements before the pace is trusted
# Seconds per token assumed for a node before anything measured it (no stream has run on
# it and its samples report no iteration latency: a fresh gateway, an idle engine). An
# optimistic prior on purpose: a prediction made on a guess should queue a request rather
# than refuse it; once requests run, their measured pace replaces it, and a waiter whose
# wait then cannot be met is refused with the measured prediction.
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
        """Seconds per token of a request running on the node: measured on its streams
        (prefill steps that interrupt decoding included, averaged over `PACE_HALFLIFE_S`),
        else from its samples' iteration latency, else a default."""
        pace = self._paces.get(node_id)
        if pace is not None and pace.value is not None and pace.count >= _PACE_MIN:
            return pace.value
        node = self._nodes.get(node_id)
        step = None if node is None else node.step_s
        return step if step is not None and step > 0 else DEFAULT_STEP_S

    def fastest_step_s(self, node_id: str) -> float:
        """The node's healthy step time (its latency baseline) when lower than the recent."""
        step = self.step_s(node_id)
        node = self._nodes.get(node_id)
        baseline = (
            None if node is None or node.latency_baseline is None else node.latency_baseline.value
        )
        if baseline is not None and 0 < baseline < step:
            return baseline
        return step
