"""`adaptive`: kvgate's placement. A request starts on a node only if the node's future KV
peak, with it, stays under the request's ceiling; otherwise it waits (`kvgate.core.flow`).

1. **Ceilings on the envelope's peak, per node.** A request may go to node n only if n is
   fresh or lagging (`core.nodes`: its page is slow but it serves), not thrashing, not at
   panic on what it holds now, and the peak of n's envelope with the request
   (`kvgate.core.plan.envelope`, built by `kvgate.core.plan.forecast`) stays under
   `ceiling(q) * capacity(n)`: the high watermark for sheddable work (it fills the cache
   only so far, leaving the rest for interactive work to start at once), the panic
   watermark for standard and critical work. A request's hold is taken at once, so no
   burst, however dense, pushes a node's peak past its ceiling. Among the nodes that fit,
   the one whose engine has the least prefill still queued wins (the prompts sent there
   that have not produced a first token: a chat sent behind a 100k-token prefill waits for
   it), and then the one with the most headroom left (power of two choices from
   `p2c_min_nodes` candidates on, falling back to a full scan when neither fits). Nodes are
   never averaged: one node at 99 % and one at 10 % are two different answers.

2. **Room promised to a waiter is respected** (`promised`): on a node whose room is
   promised from time T to a request already waiting (the head of the queue), a newcomer is
   placed only if it is expected to end by T. Small requests fill the gap before a large
   one's turn without delaying it (backfill).

3. **Feedback keeps the margin honest** (`plan.margin.MarginController`, one per node). The
   envelope assumes it knows every request on the node and how long each will run. When a
   sample shows the engine holding more than the peak planned for it just before (prompts
   larger than estimated, requests that run longer than learned, traffic that bypasses the
   gateway), the controller lowers the node's ceiling for non-critical work by a margin
   that grows while the excess lasts and decays once it is gone, down to half the high
   watermark at most.

Refusals (`Reject.reason`, also the `X-Kvgate-Reason` header); the flow controller turns the
waitable ones into a wait when the request's bound allows:
  * 429 `kv_high_watermark` (waitable) - no node has room under the request's ceiling now;
  * 429 `kv_panic` (waitable) - every node with a KV gauge holds at least the panic watermark;
  * 429 `thrashing` (waitable) - every fresh candidate is thrashing;
  * 429 `node_late` (waitable) - no candidate is fresh or lagging, but one is only late
    (`NodeState.is_late`: sampled within the lag limit, its scrapes not failing hard): the
    request waits for its next sample, as on a busy engine, and is sent nowhere meanwhile;
  * 503 `no_fresh_node` - no candidate is fresh, lagging or late (fail-closed);
  * 503 `no_backend` - the candidate list is empty;
  * 400 `no_capacity` - the request alone would pass its ceiling on every candidate: it can
    never be served as sent.

Fail mode, when no candidate node is fresh: `closed` (default) answers 503 `no_fresh_node`
and never sends traffic to nodes nobody has heard from; `open` sends the request to the
candidate heard from most recently (or round-robin among never-heard ones), without KV
checks, still holding and releasing.

Nodes with no KV gauge and no known capacity (llama.cpp without `kv_capacity_tokens`)
take requests while their last sample shows nothing waiting and they are not thrashing;
they rank behind any node with measurable headroom.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.core.admission import Reject, StartEstimate
from kvgate.core.clock import Clock
from kvgate.core.nodes import LEVEL_PANIC, NodeState
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.plan.margin import MarginController
from kvgate.core.policies.base import BasePolicy
from kvgate.core.request import AdmissionRequest, Priority
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered
from kvgate.core.settings import AdmissionSettings

# The margin lowers a ceiling to this fraction of the high watermark at most.
CEILING_FLOOR = 0.5
# A sample may exceed the planned peak by this fraction of capacity before it counts as
# evidence (KV block rounding, a gauge's own jitter).
PLAN_TOLERANCE = 0.03
# Candidate lists and request sizes whose refusals are remembered between two changes.
_MEMO_KEYS = 256
_MEMO_SIZES = 8
# Headroom score of a queue-gated node (no capacity known): behind any measurable headroom.
_UNKNOWN_HEADROOM = -1.0


class _Fit:
    """The outcome of checking one request against one node."""

    __slots__ = ("headroom", "reason")

    def __init__(self, headroom: float | None, reason: str = "") -> None:
        self.headroom = headroom  # fraction of capacity left after it; None: does not fit
        self.reason = reason


class AdaptivePolicy(BasePolicy):
    name = "adaptive"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
        feedback: bool = True,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, lengths=lengths)
        self.feedback = feedback
        self.margins: dict[str, MarginController] = {}
        self._planned: dict[str, float] = {}  # each node's planned peak before its sample
        # Per (priority, candidates): (generation, valid until, [(held, expected, refusal)]).
        self._refusals: dict[
            tuple[Priority, tuple[str, ...]], tuple[int, float, list[tuple[int, int, Reject]]]
        ] = {}

    # --- ceilings -----------------------------------------------------------------------------

    def ceiling(self, node: NodeState, priority: Priority) -> float:
        """The usage the node's peak may reach with a request of `priority` on it."""
        s = self.settings
        if priority is Priority.SHEDDABLE:
            static = s.high_watermark
        else:
            static = s.panic_watermark
        if priority is Priority.CRITICAL:
            return static
        margin = self.margins.get(node.node_id)
        if margin is None or margin.margin <= 0:
            return static
        return max(s.high_watermark * CEILING_FLOOR, static - margin.margin)

    # --- decision -----------------------------------------------------------------------------

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        candidates = request.candidates
        held = request.cost.prompt_tokens + self.tuning.reservation_overhead_tokens
        memo_key = (request.priority, candidates)
        if not promised:
            known = self._refused_memo(now, memo_key, held, expected)
            if known is not None:
                return known
        if len(candidates) >= self.tuning.p2c_min_nodes:
            node_id = self._two_choices(now, request, expected, promised)
            if node_id is not None:
                return node_id
        best: str | None = None
        best_score = (float("inf"), float("inf"))
        reasons: list[str] = []
        backlog = self.holds.prefill_backlog
        for node_id in candidates:
            fit = self._fit(now, node_id, request, expected, promised)
            if fit.headroom is None:
                reasons.append(fit.reason)
                continue
            score = (backlog(node_id), -fit.headroom)
            if score < best_score:
                best, best_score = node_id, score
        if best is not None:
            return best
        refusal = self._refuse(now, request, expected, reasons)
        if not promised and isinstance(refusal, Reject) and refusal.waitable:
            self._remember_refusal(now, memo_key, held, expected, refusal)
        return refusal

    def _refused_memo(
        self, now: float, key: tuple[Priority, tuple[str, ...]], held: int, expected: int
    ) -> Reject | None:
        """A refusal of a request no larger than this one, made since anything changed:
        it holds for this one too (it needs at least as much room, on the same nodes)."""
        memo = self._refusals.get(key)
        if memo is None or memo[0] != self.generation or now >= memo[1]:
            return None
        for smaller_held, smaller_expected, refusal in memo[2]:
            if smaller_held <= held and smaller_expected <= expected:
                return refusal
        return None

    def _remember_refusal(
        self,
        now: float,
        key: tuple[Priority, tuple[str, ...]],
        held: int,
        expected: int,
        refusal: Reject,
    ) -> None:
        """Keep a refusal until anything changes (a sample, a start, an end, the node set)
        or a node it counted on goes stale, so a storm of refusals between two samples
        costs O(1) each instead of a scan of every node."""
        memo = self._refusals.get(key)
        if memo is None or memo[0] != self.generation or now >= memo[1]:
            if len(self._refusals) >= _MEMO_KEYS:
                self._refusals.clear()
            until = min(
                (n.sample.sampled_at + self.settings.stale_after_s
                 for nid in key[1]
                 if (n := self.nodes.get(nid)) is not None and n.sample is not None),
                default=now,
            )  # fmt: skip
            memo = self._refusals[key] = (self.generation, until, [])
        if len(memo[2]) < _MEMO_SIZES:
            memo[2].append((held, expected, refusal))

    def _two_choices(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | None:
        candidates = request.candidates
        n = len(candidates)
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        best: str | None = None
        best_score = (float("inf"), float("inf"))
        for node_id in (candidates[i], candidates[j + (j >= i)]):
            fit = self._fit(now, node_id, request, expected, promised)
            if fit.headroom is None:
                continue
            score = (self.holds.prefill_backlog(node_id), -fit.headroom)
            if score < best_score:
                best, best_score = node_id, score
        return best

    def _fit(
        self,
        now: float,
        node_id: str,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> _Fit:
        """Does the request fit on the node now; with how much headroom left, or why not."""
        node = self.nodes.get(node_id)
        if node is None or not node.is_live(now, self.settings):
            late = node is not None and node.is_late(now, self.settings)
            return _Fit(None, "late" if late else "stale")
        if node.thrashing:
            return _Fit(None, "thrashing")
        until = promised.get(node_id)
        if until is not None and now + expected * self.pace.step_s(node_id) > until:
            return _Fit(None, "promised")
        cap = node.cap
        if cap is None:
            sample = node.sample
            if node.level == LEVEL_PANIC or (sample is not None and sample.waiting):
                return _Fit(None, "full")
            return _Fit(_UNKNOWN_HEADROOM)
        if node.level == LEVEL_PANIC:
            return _Fit(None, "panic")
        limit = self.ceiling(node, request.priority) * cap
        held = request.cost.prompt_tokens + self.tuning.reservation_overhead_tokens
        final = held + expected
        allowance = self.claims.left.get(node_id)
        if allowance is not None and final > allowance:
            return _Fit(None, "share")  # other replicas hold the rest until the next sync
        forecast = self.forecast
        if forecast.peers.isolated:
            return self._fit_isolated(node, limit, held, expected)
        upper = node.used + self.holds.reserved_on(node_id) + forecast.peers_upper(node_id) + final
        if upper <= limit:
            return _Fit((limit - upper) / cap)
        envelope = forecast.envelope(node)
        if envelope.floor(held, expected) > limit:
            return _Fit(None, "full")  # not now, and not even once all that runs has ended
        peak = envelope.peak(held, expected)
        if peak > limit:
            return _Fit(None, "full")
        return _Fit((limit - peak) / cap)

    def _fit_isolated(self, node: NodeState, limit: float, held: int, expected: int) -> _Fit:
        """Without the other replicas' views: this replica's part of the node
        (`Claims.isolated_headroom`)."""
        headroom = self.claims.isolated_headroom(node, limit, held, expected)
        return _Fit(None, "full") if headroom is None else _Fit(headroom)

    def _refuse(
        self, now: float, request: AdmissionRequest, expected: int, reasons: list[str]
    ) -> str | Reject:
        if all(reason in ("stale", "late") for reason in reasons):
            if "late" in reasons and self.settings.fail_mode == "closed":
                return self._late()
            return self._no_fresh(now, request.candidates)
        need = self.footprint(request, expected)
        cost = request.cost
        at_least = cost.floor_total + self.tuning.reservation_overhead_tokens
        if self._never_fits(request, at_least):
            prompt = cost.prompt_tokens if cost.prompt_floor is None else cost.prompt_floor
            return Reject(
                400,
                "no_capacity",
                0.0,
                f"This request needs at least {at_least} KV tokens ({prompt} in the prompt,"
                f" up to {cost.max_output_tokens} generated), more than any backend for this"
                f" model holds ({self._most_held(request)} tokens for"
                f" {request.priority.label} requests). Shorten the prompt or lower max_tokens.",
            )
        fresh = [r for r in reasons if r not in ("stale", "late")]
        if fresh and all(r == "thrashing" for r in fresh):
            return self.reject_shed(
                "thrashing",
                "Every backend for this model is thrashing (preempting); retry later.",
                now,
                need,
                waitable=True,
            )
        if any(r == "panic" for r in fresh) and all(r in ("panic", "thrashing") for r in fresh):
            reason, what = "kv_panic", "at its panic watermark"
        else:
            reason, what = "kv_high_watermark", "too full"
        return self.reject_shed(
            reason,
            f"The KV cache of every backend for this model is {what}"
            f" for {request.priority.label} requests; retry later.",
            now,
            need,
            waitable=True,
        )

    def _most_held(self, request: AdmissionRequest) -> int:
        """The largest footprint any candidate could hold for this request's priority."""
        most = 0
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            cap = None if node is None else node.capacity(self.settings)
            if cap is not None and node is not None:
                most = max(most, int(self.ceiling(node, request.priority) * cap))
        return most

    def _never_fits(self, request: AdmissionRequest, need: int) -> bool:
        """True when every candidate's capacity is known and none could hold the request
        alone under its priority's static ceiling."""
        static = (
            self.settings.high_watermark
            if request.priority is Priority.SHEDDABLE
            else self.settings.panic_watermark
        )
        known = False
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            cap = None if node is None else node.capacity(self.settings)
            if cap is None:
                return False
            known = True
            if need <= static * cap:
                return False
        return known

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

    def _late(self) -> Reject:
        """Waitable: a candidate's page may only be answering late (a waiter waits for its
        next sample); a request that cannot wait retries after about one staleness period."""
        centre = min(max(1.0, self.settings.stale_after_s), MAX_RETRY_AFTER_S)
        return Reject(
            429,
            "node_late",
            jittered(centre, self.rng, MAX_RETRY_AFTER_S),
            "No backend for this model has reported its state within"
            f" {self.settings.stale_after_s:g} s, but one may only be answering late; retry"
            " shortly.",
            waitable=True,
        )

    # --- scheduling questions -------------------------------------------------------------

    def start_estimate(self, request: AdmissionRequest) -> StartEstimate | None:
        """The candidate where the request could start soonest, and in how many seconds,
        from each node's envelope (its ends at the node's measured step time)."""
        now = self.clock.now()
        expected = self.lengths.expected(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        final = self.footprint(request, expected)
        best: StartEstimate | None = None
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None or node.thrashing:
                continue
            if not node.is_live(now, self.settings) and not node.is_late(now, self.settings):
                continue  # a late node's start is predicted from its last sample
            limit = self.ceiling(node, request.priority) * node.cap
            estimate = self.forecast.start_estimate(node, final, limit)
            if estimate is not None and (best is None or estimate.seconds < best.seconds):
                best = estimate
        return best

    def shortfall(self, request: AdmissionRequest) -> float:
        """The least a candidate must free for the request to fit under its ceiling: its
        planned peak with the request, less the ceiling (what a node over its ceiling
        because of load kvgate cannot see must shed first, the request's own size on top)."""
        expected = self.lengths.expected(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        held = request.cost.prompt_tokens + self.tuning.reservation_overhead_tokens
        least: float | None = None
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None:
                continue
            limit = self.ceiling(node, request.priority) * node.cap
            short = max(0.0, self.forecast.envelope(node).peak(held, expected) - limit)
            if least is None or short < least:
                least = short
        return super().shortfall(request) if least is None else least

    # --- feedback -------------------------------------------------------------------------------

    def _before_observe(self, node: NodeState) -> None:
        if self.feedback and node.cap and node.sample is not None:
            self._planned[node.node_id] = self.forecast.envelope(node).peak() / node.cap

    def _on_observe(self, now: float, node: NodeState) -> None:
        if not self.feedback:
            return
        sample = node.sample
        if sample is None or sample.kv_usage is None or node.cap is None:
            return
        margin = self.margins.get(node.node_id)
        panic = self.settings.panic_watermark
        if margin is None:
            floor = self.settings.high_watermark * CEILING_FLOOR
            margin = self.margins[node.node_id] = MarginController(panic - floor)
        # Evidence that the plan is wrong: the engine holds more than the peak that was
        # planned for it (never judged above the panic watermark).
        planned = self._planned.pop(node.node_id, panic) + PLAN_TOLERANCE
        margin.update(now, sample.kv_usage, min(panic, planned))

    def remove_node(self, node_id: str) -> None:
        super().remove_node(node_id)
        self.margins.pop(node_id, None)

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        return {
            **super()._controller_snapshot(now),
            "feedback": self.feedback,
            "margins": {nid: m.margin for nid, m in self.margins.items()},
        }

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = super()._node_snapshot(now, node)
        margin = self.margins.get(node.node_id)
        entry["margin"] = 0.0 if margin is None else margin.margin
        if node.cap is not None:
            entry["peak_usage"] = self.forecast.envelope(node).peak() / node.cap
        else:
            entry["peak_usage"] = None
        return entry
