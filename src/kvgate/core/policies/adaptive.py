"""`adaptive`: kvgate's policy. Admission by predicted KV cost, per node, with feedback.

Two layers, so that safety never depends on a control loop that runs at sample rate:

1. **Deterministic ceilings, per node, at admission time.** A request of priority q may go
   to node n only if n is fresh, not thrashing, not in the panic state, and
   `predicted_tokens(n) + reservation <= ceiling(q) * capacity(n)`, where
   ceiling(sheddable) = high watermark, ceiling(standard) = `standard_ceiling` (midway to
   panic by default) and ceiling(critical) = panic watermark. Predicted tokens include
   every reservation the engine cannot reflect yet (see `policies.base`), and the
   reservation is taken at once, so no burst, however dense, pushes a node past panic.
   Among the nodes that fit, the one with the most headroom wins (power of two choices
   from `p2c_min_nodes` candidates on, falling back to a full scan when neither fits).
   Nodes are never averaged: one node at 99 % and one at 10 % are two different answers.

2. **Feedback between the watermarks, per node** (`limits.PidLimit`, one per node, updated
   on each of its samples). It measures the node's predicted usage and holds it at the
   high watermark by raising a pressure 0..1. The pressure (a) lowers the node's ceiling
   for non-critical work from `standard_ceiling` towards the high watermark (the node's
   token budget) and (b) sets shedding probabilities for requests routed to that node:
   sheddable `min(1, 2p)`, standard `max(0, 2p - 1)`, critical never. Requests are routed
   first and then face the pressure of the node they would land on, so a busy node never
   causes shedding of traffic a calm node can take. Draws come from a seeded
   `random.Random`: simultaneous requests are independent and runs reproducible.

Fail mode, when no candidate node is fresh: `closed` (default) answers 503 `no_fresh_node`
with a Retry-After of about one staleness period and never sends traffic to nodes nobody
has heard from; `open` sends the request to the candidate heard from most recently (or
round-robin among never-heard ones), without KV checks, still reserving and releasing.

Nodes with no KV gauge and no known capacity (llama.cpp without `default_capacity_tokens`)
take requests while their last sample shows nothing waiting and they are not thrashing;
they rank behind any node with measurable headroom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvgate.core.admission import Reject
from kvgate.core.clock import Clock
from kvgate.core.limits import LimitMeasurement, PidLimit, TokenLimit
from kvgate.core.nodes import LEVEL_PANIC, NodeState
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import Priority, RequestCost
from kvgate.core.reservations import ReservationStore
from kvgate.core.settings import AdmissionSettings

# Headroom score of a queue-gated node (no capacity known): behind any measurable headroom.
_UNKNOWN_HEADROOM = -1.0


class AdaptivePolicy(BasePolicy):
    name = "adaptive"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        store: ReservationStore | None = None,
        limit_factory: Callable[[], TokenLimit] | None = None,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, store=store)
        self._new_limit = limit_factory or self._pid
        self.limits: dict[str, TokenLimit] = {}
        self._ceilings = {
            Priority.SHEDDABLE: settings.high_watermark,
            Priority.STANDARD: settings.standard_ceiling_value,
            Priority.CRITICAL: settings.panic_watermark,
        }

    def _pid(self) -> TokenLimit:
        s = self.settings
        return PidLimit(
            s.high_watermark,
            s.panic_watermark,
            kp=s.controller_kp,
            ki=s.controller_ki,
            kd=s.controller_kd,
            hysteresis=s.hysteresis,
        )

    # --- decision -----------------------------------------------------------------------------

    def _decide(
        self, now: float, cost: RequestCost, priority: Priority, candidates: Sequence[str]
    ) -> str | Reject:
        fresh = self._fresh(now, candidates)
        if not fresh:
            return self._no_fresh(now, candidates)
        usable = [node for node in fresh if not node.is_thrashing(now)]
        need = self.reservation_for(cost)
        if not usable:
            return self.reject_shed(
                "thrashing",
                "Every backend for this model is thrashing (preempting); retry later.",
                now,
                need,
            )
        node = self._route(usable, need, priority)
        if node is None:
            return self._no_fit(now, usable, need, priority)
        shed = self._shed_by_controller(now, node, priority, need)
        return shed if shed is not None else node.node_id

    def _fresh(self, now: float, candidates: Sequence[str]) -> list[NodeState]:
        nodes = self.nodes
        settings = self.settings
        fresh = []
        for node_id in candidates:
            node = nodes.get(node_id)
            if node is not None and node.is_fresh(now, settings):
                fresh.append(node)
        return fresh

    def _no_fresh(self, now: float, candidates: Sequence[str]) -> str | Reject:
        if self.settings.fail_mode == "open":
            heard = [
                (node.last_heard(), node_id)
                for node_id in candidates
                if (node := self.nodes.get(node_id)) is not None and node.sample is not None
            ]
            if heard:
                return max(heard)[1]
            return self.least_loaded(candidates)
        return self._reject_unavailable(
            "no_fresh_node",
            "No backend for this model has reported its state recently; retry shortly.",
            now,
        )

    def _shed_by_controller(
        self, now: float, node: NodeState, priority: Priority, need: int
    ) -> Reject | None:
        probability = self._shed_probability(node.node_id, priority)
        if probability > 0 and self.rng.random() < probability:
            limit = self.limits[node.node_id]
            excess = need
            capacity = node.capacity(self.settings)
            predicted = self.predicted_tokens(node)
            if capacity is not None and predicted is not None:
                excess += max(0.0, predicted - limit.setpoint * capacity)
            return self.reject_shed(
                "kv_high_watermark",
                f"The KV cache is above its target; {priority.name.lower()}"
                " requests are being shed. Retry later.",
                now,
                excess,
            )
        return None

    def pressure(self, node_id: str) -> float:
        limit = self.limits.get(node_id)
        return 0.0 if limit is None else limit.pressure

    def _shed_probability(self, node_id: str, priority: Priority) -> float:
        pressure = self.pressure(node_id)
        if priority is Priority.SHEDDABLE:
            return min(1.0, 2.0 * pressure)
        if priority is Priority.STANDARD:
            return max(0.0, 2.0 * pressure - 1.0)
        return 0.0

    def _ceiling(self, node_id: str, priority: Priority) -> float:
        static = self._ceilings[priority]
        if priority is Priority.CRITICAL:
            return static
        limit = self.limits.get(node_id)
        return static if limit is None else min(static, limit.ceiling)

    def _headroom(self, node: NodeState, need: int, priority: Priority) -> float | None:
        """Fraction of capacity left under the ceiling after `need`; None when it won't fit."""
        if node.level == LEVEL_PANIC:
            return None
        capacity = node.capacity(self.settings)
        predicted = self.predicted_tokens(node)
        if capacity is None or predicted is None:
            sample = node.sample
            return _UNKNOWN_HEADROOM if sample is not None and sample.waiting == 0 else None
        left = self._ceiling(node.node_id, priority) * capacity - predicted - need
        return left / capacity if left >= 0 else None

    def _route(self, nodes: list[NodeState], need: int, priority: Priority) -> NodeState | None:
        if len(nodes) >= self.settings.p2c_min_nodes:
            a, b = self.rng.sample(nodes, 2)
            ha, hb = self._headroom(a, need, priority), self._headroom(b, need, priority)
            if ha is not None or hb is not None:
                if hb is None or (ha is not None and ha >= hb):
                    return a
                return b
        best: NodeState | None = None
        best_headroom = float("-inf")
        for node in nodes:
            headroom = self._headroom(node, need, priority)
            if headroom is not None and headroom > best_headroom:
                best, best_headroom = node, headroom
        return best

    def _no_fit(self, now: float, nodes: list[NodeState], need: int, priority: Priority) -> Reject:
        panic = self.settings.panic_watermark
        capacities = [c for node in nodes if (c := node.capacity(self.settings)) is not None]
        if capacities and len(capacities) == len(nodes) and need > panic * max(capacities):
            return self._reject_unavailable(
                "no_capacity",
                f"This request may hold {need} KV tokens, more than any backend can hold;"
                " lower max_tokens or shorten the prompt.",
                now,
                retry_s=self.settings.retry_after_max_s,
            )
        excess = float("inf")
        at_panic = False
        for node in nodes:
            capacity = node.capacity(self.settings)
            predicted = self.predicted_tokens(node)
            if capacity is None or predicted is None:
                continue
            ceiling = self._ceiling(node.node_id, priority)
            excess = min(excess, predicted + need - ceiling * capacity)
            at_panic = at_panic or node.level == LEVEL_PANIC or predicted + need > panic * capacity
        if excess == float("inf"):
            excess = float(need)
        if priority is Priority.CRITICAL or at_panic:
            reason, what = "kv_panic", "at its panic watermark"
        else:
            reason, what = "kv_high_watermark", "above its high watermark"
        return self.reject_shed(
            reason,
            f"The KV cache of every backend for this model is {what}"
            f" for {priority.name.lower()} requests; retry later.",
            now,
            max(excess, 0.0),
        )

    # --- control loop -------------------------------------------------------------------------

    def _on_observe(self, now: float, node: NodeState) -> None:
        capacity = node.capacity(self.settings)
        predicted = self.predicted_tokens(node)
        if capacity is None or predicted is None:
            return
        limit = self.limits.get(node.node_id)
        if limit is None:
            limit = self.limits[node.node_id] = self._new_limit()
        own = self.full_reserved_on(node.node_id)
        limit.update(
            LimitMeasurement(
                now=now,
                usage=predicted / capacity,
                capacity_tokens=capacity,
                other_tokens=predicted - own,
                in_flight_tokens=own,
            )
        )

    def remove_node(self, node_id: str) -> None:
        super().remove_node(node_id)
        self.limits.pop(node_id, None)

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        """Cluster view: budgets summed over fresh nodes; the shedding probabilities a request
        faces on the least-pressured fresh node (the best a well-routed request can get)."""
        budget: float | None = None
        least: str | None = None
        for node_id, node in self.nodes.items():
            limit = self.limits.get(node_id)
            if limit is None or not node.is_fresh(now, self.settings):
                continue
            if limit.budget_tokens is not None:
                budget = (budget or 0.0) + limit.budget_tokens
            if least is None or limit.pressure < self.pressure(least):
                least = node_id
        probabilities = {
            q.name.lower(): (self._shed_probability(least, q) if least is not None else 0.0)
            for q in (Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE)
        }
        return {
            "budget_tokens": budget,
            "in_flight_tokens": self.in_flight_tokens,
            "setpoint": self.settings.high_watermark,
            "shed_probability": probabilities,
            "limit": "pid",
        }

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = super()._node_snapshot(now, node)
        limit = self.limits.get(node.node_id)
        entry["pressure"] = 0.0 if limit is None else limit.pressure
        entry["budget_tokens"] = None if limit is None else limit.budget_tokens
        return entry
