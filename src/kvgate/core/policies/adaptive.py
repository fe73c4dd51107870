"""`adaptive`: kvgate's placement. A request starts on a node only if the node's future KV
peak, with it, stays under the request's ceiling; otherwise it waits (`kvgate.core.flow`).

1. **Ceilings on the envelope's peak, per node.** A request may go to node n only if n is fresh or
   lagging (`core.nodes`: its page is slow but it serves), not thrashing, not at panic on what it
   holds now, and the peak of n's envelope with the request (`kvgate.core.plan.envelope`, built by
   `kvgate.core.plan.forecast`) stays under `ceiling(q) * capacity(n)`: the high watermark for
   sheddable work (it fills the cache only so far, leaving the rest for interactive work to start at
   once), the panic watermark for standard and critical work; above the cache for a request cheap to
   recompute where the node's measurement allows it (`kvgate.core.plan.ceiling`: the engine's
   preemption is then the plan's own; it comes back to the watermarks where preemption costs goodput
   or latency). A request counts on a node, in its peak and in what recomputing it costs, what that
   node lacks: its prompt less the leading blocks requests running there hold already
   (`BasePolicy.sharing`). A request's hold is taken at once, so no burst, however dense, pushes a
   node's peak past its ceiling. Among the nodes that fit, the routing part ranks
   (`kvgate.core.policies.routing`: by the prefill the request would wait for there, counting the
   node's cached prefix of its prompt, and the headroom left under the panic watermark; or by
   headroom alone). From `p2c_min_nodes` candidates on, only two random nodes and the ones the
   routing names (those holding the prompt's longest cached prefix deeper) are checked, falling back
   to a full scan when none fits. Nodes are never averaged: one node at 99 % and one at 10 % are two
   different answers.

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
   watermark at most. While the node is planned above its cache the engine is meant to be
   full: the margin then only decays.

Refusals (`Reject.reason`, also the `X-Kvgate-Reason` header; the words of the ones that
find no room are `kvgate.core.policies.refusals`'); the flow controller turns the waitable
ones into a wait when the request's bound allows:
  * 429 `kv_planned_peak` (waitable) - on no node does the planned peak with the request
    stay under its ceiling now (the message names the closest: its planned peak, the
    ceiling, and what its engine reports);
  * 429 `replica_claim` (waitable) - the other replicas hold the rest of the room until
    their next sync;
  * 429 `engine_queue` (waitable) - no node has a KV gauge and each has requests queued;
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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvgate.core.admission import Outcome, Reject, StartEstimate, Ticket
from kvgate.core.clock import Clock
from kvgate.core.nodes import LEVEL_PANIC, NodeState
from kvgate.core.plan.ceiling import Ceilings
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.plan.margin import MarginController
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.refusals import Fit, RefusalMemo, no_room, planned_peak
from kvgate.core.policies.routing import PrefixRouting, Route, Routing, RoutingName, build_routing
from kvgate.core.prefix.events import KVEventBatch
from kvgate.core.request import AdmissionRequest, Priority
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered
from kvgate.core.settings import AdmissionSettings

# The margin lowers a ceiling to this fraction of the high watermark at most.
CEILING_FLOOR = 0.5
# A sample may exceed the planned peak by this fraction of capacity before it counts as
# evidence (KV block rounding, a gauge's own jitter).
PLAN_TOLERANCE = 0.03
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
        lengths: OutputLengths | None = None,
        feedback: bool = True,
        routing: RoutingName = "prefix",
        overbook: bool = True,
    ) -> None:
        super().__init__(settings, clock, rng_seed=rng_seed, lengths=lengths)
        self.feedback = feedback
        self.overbook = overbook
        self.routing: Routing = build_routing(routing, self.block_sizes, self.prompt_blocks)
        self.margins: dict[str, MarginController] = {}
        self.ceilings = Ceilings(self.holds)
        self._planned: dict[str, float] = {}  # each node's planned peak before its sample
        self._prefix_queries: dict[str, float] = {}  # each engine's prefix cache counter
        self._memo = RefusalMemo(self.tuning.reservation_overhead_tokens)

    # --- ceilings -----------------------------------------------------------------------------

    def ceiling(self, node: NodeState, priority: Priority, cheap: bool = False) -> float:
        """The usage the node's peak may reach with a request of `priority` on it; above
        the panic watermark (`kvgate.core.plan.ceiling`) for a request `cheap` to preempt
        where the node's measured overbooking allows it."""
        s = self.settings
        static = s.high_watermark if priority is Priority.SHEDDABLE else s.panic_watermark
        margin = self.margins.get(node.node_id)
        lowered = 0.0 if margin is None or priority is Priority.CRITICAL else margin.margin
        if cheap and self.overbook:
            over = self.ceilings.overbook(node.node_id, priority, self.clock.now())
            if over > 0:
                return max(static, s.panic_watermark + over - lowered)
        if lowered <= 0:
            return static
        return max(s.high_watermark * CEILING_FLOOR, static - lowered)

    def _limit(
        self, node: NodeState, request: AdmissionRequest, expected: int, prompt: int
    ) -> float:
        """The request's ceiling on the node, where it adds `prompt` tokens: above the
        cache if it may be placed there (`_may_overbook`) and that prompt fits the cache now,
        next to every prompt sent to the node: the engine queues nothing kvgate could keep.
        The overbooking is asked first: where it allows none (the common case) nothing else
        is computed on this path, which every candidate of every decision takes."""
        if not self.overbook or (
            self.ceilings.overbook(node.node_id, request.priority, self.clock.now()) <= 0
        ):
            return self.ceiling(node, request.priority)
        held = prompt + self.tuning.reservation_overhead_tokens
        above = node.cap is not None and self._may_overbook(node, prompt, expected)
        if above:
            now = self.forecast.now_tokens(node)
            above = now is None or now + held <= self.settings.panic_watermark * (node.cap or 0)
        return self.ceiling(node, request.priority, above)

    def _may_overbook(self, node: NodeState, prompt: int, expected: int) -> bool:
        """Is a request adding `prompt` tokens (what the node lacks: blocks other requests
        hold stay cached when it is preempted, so only its own part is recomputed) cheap to
        preempt there (`kvgate.core.plan.ceiling.cheap`) and small enough to fit its cache
        alone, so that its ceiling may lie above the cache, as the overbooking allows."""
        if node.cap is None or not self.overbook:
            return False
        alone = prompt + self.tuning.reservation_overhead_tokens + expected
        return alone <= self.settings.panic_watermark * node.cap and self.ceilings.is_cheap(
            node.node_id, prompt, expected
        )

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
            known = self._memo.recall(self.generation, now, memo_key, held, expected)
            if known is not None:
                return known
        route = self.routing.query(request)
        if len(candidates) >= self.tuning.p2c_min_nodes:
            node_id = self._two_choices(now, request, expected, promised, route)
            if node_id is not None:
                return node_id
        best: str | None = None
        best_above = False
        best_score = (float("inf"), float("inf"))
        misses: list[Fit] = []
        backlog = self.holds.prefill_backlog
        for node_id in candidates:
            fit = self._fit(now, node_id, request, expected, promised)
            if fit.headroom is None:
                misses.append(fit)
                continue
            score = route.score(node_id, backlog(node_id), fit.headroom)
            if score < best_score:
                best, best_score, best_above = node_id, score, fit.above
        if best is not None:
            if best_above:
                self.ceilings.placed_above(best, now)
            return best
        refusal = self._refuse(now, request, expected, misses)
        if not promised and isinstance(refusal, Reject) and refusal.waitable:
            until = min(
                (n.sample.sampled_at + self.settings.stale_after_s
                 for nid in candidates
                 if (n := self.nodes.get(nid)) is not None and n.sample is not None),
                default=now,
            )  # fmt: skip
            sizes = (held, expected)
            self._memo.remember(self.generation, now, until, memo_key, sizes, refusal)
        return refusal

    def _two_choices(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
        route: Route,
    ) -> str | None:
        """The best of two random candidates and the ones the route names (`Route.extra`)."""
        candidates = request.candidates
        n = len(candidates)
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        best: str | None = None
        best_above = False
        best_score = (float("inf"), float("inf"))
        a, b = candidates[i], candidates[j + (j >= i)]
        for node_id in (a, b, *route.extra(a, b)):
            fit = self._fit(now, node_id, request, expected, promised)
            if fit.headroom is None:
                continue
            score = route.score(node_id, self.holds.prefill_backlog(node_id), fit.headroom)
            if score < best_score:
                best, best_score, best_above = node_id, score, fit.above
        if best is not None and best_above:
            self.ceilings.placed_above(best, now)
        return best

    def _fit(
        self,
        now: float,
        node_id: str,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> Fit:
        """Does the request fit on the node now; with how much headroom left, or why not."""
        node = self.nodes.get(node_id)
        if node is None or not node.is_live(now, self.settings):
            late = node is not None and node.is_late(now, self.settings)
            return Fit(None, "late" if late else "stale")
        if node.thrashing:
            return Fit(None, "thrashing")
        until = promised.get(node_id)
        if until is not None and now + expected * self.pace.step_s(node_id) > until:
            return Fit(None, "promised")
        cap = node.cap
        if cap is None:
            sample = node.sample
            if node.level == LEVEL_PANIC:
                return Fit(None, "panic")
            if sample is not None and sample.waiting:
                return Fit(None, "queue")
            return Fit(_UNKNOWN_HEADROOM)
        if node.level == LEVEL_PANIC:
            return Fit(None, "panic")
        # What the node lacks: the prompt less the blocks its running requests hold already.
        prompt = self.sharing.lacks(node_id, request)
        held = prompt + self.tuning.reservation_overhead_tokens
        final = held + expected
        allowance = self.claims.left.get(node_id)
        if allowance is not None and final > allowance:
            return Fit(None, "share")  # other replicas hold the rest until the next sync
        forecast = self.forecast
        if forecast.peers.isolated:
            limit = self.ceiling(node, request.priority) * cap
            return self._fit_isolated(node, limit, held, expected)
        if until is None:
            limit = self._limit(node, request, expected, prompt) * cap
        else:  # a waiter's turn is coming on the node: no room above the cache meanwhile
            limit = self.ceiling(node, request.priority) * cap
        panic = self.settings.panic_watermark * cap
        # Nodes are ranked by their room under panic: room above the cache is no preference.
        room = min(limit, panic)
        used = forecast.used(node)
        upper = used + self.holds.reserved_on(node_id) + forecast.peers_upper(node_id) + final
        if upper <= limit:
            return Fit((room - upper) / cap, above=upper > panic)
        envelope = forecast.envelope(node)
        floor = envelope.floor(held, expected)
        if floor > limit:  # not now, and not even once all that runs has ended
            return planned_peak(node, floor, limit)
        peak = envelope.peak(held, expected)
        if peak > limit:
            return planned_peak(node, peak, limit)
        return Fit((room - peak) / cap, above=peak > panic)

    def _fit_isolated(self, node: NodeState, limit: float, held: int, expected: int) -> Fit:
        """Without the other replicas' views: this replica's part of the node
        (`Claims.isolated_headroom`)."""
        headroom = self.claims.isolated_headroom(node, limit, held, expected)
        if headroom is None:
            return planned_peak(node, self.forecast.envelope(node).peak(held, expected), limit)
        return Fit(headroom)

    def _refuse(
        self, now: float, request: AdmissionRequest, expected: int, misses: list[Fit]
    ) -> str | Reject:
        reasons = [fit.reason for fit in misses]
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
        fresh = [fit for fit in misses if fit.reason not in ("stale", "late")]
        if fresh and all(fit.reason == "thrashing" for fit in fresh):
            return self.reject_shed(
                "thrashing",
                "Every backend for this model is thrashing (preempting); retry later.",
                now,
                need,
                waitable=True,
            )
        reason, message, planned = no_room(fresh, request.priority)
        refusal = self.reject_shed(reason, message, now, need, waitable=True)
        return refusal if planned is None else replace(refusal, planned=planned)

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
        informed = self.lengths.informed(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        best: StartEstimate | None = None
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None or node.thrashing:
                continue
            if not node.is_live(now, self.settings) and not node.is_late(now, self.settings):
                continue  # a late node's start is predicted from its last sample
            estimate = self._start_on(node, request, expected, final, informed)
            if estimate is not None and (best is None or estimate.seconds < best.seconds):
                best = estimate
        return best

    def _start_on(
        self, node: NodeState, request: AdmissionRequest, expected: int, final: int, informed: bool
    ) -> StartEstimate | None:
        """When the request could start on the node: under its fixed ceiling, or, where it
        may be planned above the cache, once the plan has room under that ceiling and the
        cache has freed room for its prompt, whichever is sooner."""
        assert node.cap is not None
        prompt = self.sharing.lacks(node.node_id, request)
        final -= request.cost.prompt_tokens - prompt  # blocks the node holds count once
        fixed = self.ceiling(node, request.priority) * node.cap
        estimate = self.forecast.start_estimate(node, final, fixed, informed)
        over = self.ceiling(node, request.priority, cheap=True)
        if over * node.cap <= fixed or not self._may_overbook(node, prompt, expected):
            return estimate
        above = self.forecast.start_estimate(node, final, over * node.cap, informed)
        now = self.forecast.now_tokens(node) or 0.0
        held = prompt + self.tuning.reservation_overhead_tokens
        short = now + held - self.settings.panic_watermark * node.cap
        node_id = node.node_id
        cache = 0.0 if short <= 0 else self.forecast.drain_time(short, (node_id,), self.generation)
        if above is None or cache is None:
            return estimate
        seconds = max(above.seconds, cache)
        if estimate is not None and estimate.seconds <= seconds:
            return estimate
        soonest = min(seconds, max(above.soonest_s, cache))
        return StartEstimate(node_id, seconds, soonest, above.measured)

    def shortfall(self, request: AdmissionRequest) -> float:
        """The least a candidate must free for the request to fit under its ceiling: its
        planned peak with the request, less the ceiling (what a node over its ceiling
        because of load kvgate cannot see must shed first, the request's own size on top)."""
        expected = self.lengths.expected(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        least: float | None = None
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None:
                continue
            prompt = self.sharing.lacks(node_id, request)
            held = prompt + self.tuning.reservation_overhead_tokens
            limit = self._limit(node, request, expected, prompt) * node.cap
            short = max(0.0, self.forecast.envelope(node).peak(held, expected) - limit)
            if least is None or short < least:
                least = short
        return super().shortfall(request) if least is None else least

    # --- feedback -------------------------------------------------------------------------------

    def on_first_token(self, ticket: Ticket) -> None:
        self._streamed(ticket, super().on_first_token)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        self._streamed(ticket, lambda t: BasePolicy.on_tokens(self, t, output_tokens))

    def _streamed(self, ticket: Ticket, event: Callable[[Ticket], None]) -> None:
        """The base policy's stream event; what it changed feeds the node's meter."""
        hold = self.holds.live.get(ticket.key)
        if hold is None or not self.overbook:
            return event(ticket)
        prefilled, tokens = hold.prefilled, hold.tok_cur
        event(ticket)
        self.ceilings.streamed(hold, prefilled, tokens, ticket.first_token_at, self.clock.now())

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        hold = self.holds.live.get(ticket.key)
        if hold is not None and not ticket.released:
            self.ceilings.ended(hold)
        super().release(ticket, outcome)

    def _before_observe(self, node: NodeState) -> None:
        if node.cap and node.sample is not None and (self.feedback or self.overbook):
            peak = self.forecast.envelope(node).peak() / node.cap
            self._planned[node.node_id] = peak
            if self.overbook:
                panic = self.settings.panic_watermark
                self.ceilings.planned(node, self.clock.now(), peak, panic)

    def _on_observe(self, now: float, node: NodeState) -> None:
        planned = self._planned.pop(node.node_id, None)
        if node.cap is not None:
            self.routing.capacity(node.node_id, node.cap)
        self._prefix_reset(node)
        sample = node.sample
        if sample is None:
            return
        if self.overbook:
            self.ceilings.sampled(node, now, sample)
        if not self.feedback or sample.kv_usage is None or node.cap is None:
            return
        margin = self.margins.get(node.node_id)
        panic = self.settings.panic_watermark
        if margin is None:
            floor = self.settings.high_watermark * CEILING_FLOOR
            margin = self.margins[node.node_id] = MarginController(panic - floor)
        # Evidence that the plan is wrong: the engine holds more than the peak that was
        # planned for it (never judged above the panic watermark). Not while kvgate itself
        # planned the node above its cache (`kvgate.core.plan.ceiling`): the engine is meant
        # to be full then.
        if node.preemption_tolerated:
            margin.update(now, 0.0, panic)  # no evidence either way: it fades
        else:
            target = panic if planned is None else planned + PLAN_TOLERANCE
            margin.update(now, sample.kv_usage, min(panic, target))

    def remove_node(self, node_id: str) -> None:
        super().remove_node(node_id)
        self.margins.pop(node_id, None)
        self.ceilings.forget(node_id)
        self._prefix_queries.pop(node_id, None)
        self.routing.forget(node_id)

    # --- routing --------------------------------------------------------------------------------

    def _prefix_reset(self, node: NodeState) -> None:
        """The engine's block size, and its prefix cache emptied by a restart (its counters
        started again): the prefix routing's index follows."""
        if not isinstance(self.routing, PrefixRouting):
            return
        size = self.block_sizes.get(node.node_id)
        if size:
            self.routing.block_size(node.node_id, size)  # a new size resets its index
        queries = None if node.sample is None else node.sample.prefix_queries_total
        if queries is not None:
            last = self._prefix_queries.get(node.node_id)
            self._prefix_queries[node.node_id] = queries
            if last is not None and queries < last:
                self.routing.events.reset(node.node_id)

    def _open(
        self, now: float, request: AdmissionRequest, node_id: str, expected: int, cached: int = 0
    ) -> Ticket:
        cached = self.routing.query(request).cached(node_id)
        ticket = super()._open(now, request, node_id, expected, cached)
        ticket.route = self.routing.placed(node_id, request)
        return ticket

    def kv_events(self, node_id: str, batch: KVEventBatch) -> None:
        """An engine's KV events (`kvgate.core.prefix.events.KVEventSink`): the prefix
        routing's index follows them; the headroom routing ignores them."""
        if isinstance(self.routing, PrefixRouting):
            self.routing.kv_events(node_id, batch)

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        return {
            **super()._controller_snapshot(now),
            "routing": self.routing.name,
            "feedback": self.feedback,
            "overbook": self.overbook,
            "margins": {nid: m.margin for nid, m in self.margins.items()},
        }

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = super()._node_snapshot(now, node)
        margin = self.margins.get(node.node_id)
        entry["margin"] = 0.0 if margin is None else margin.margin
        entry.update(self.routing.node_snapshot(node.node_id))
        cap = node.cap
        entry["peak_usage"] = None if cap is None else self.forecast.envelope(node).peak() / cap
        # The ceiling for cheap standard work, why, and what it was measured from.
        entry["ceiling"] = self.ceiling(node, Priority.STANDARD, cheap=True)
        measured = self.ceilings.snapshot(node.node_id, now) if self.overbook else None
        measured = measured or {"reason": "fixed", "detail": ""}
        entry["ceiling_reason"], entry["ceiling_detail"] = (
            measured.pop("reason"),
            measured.pop("detail"),
        )
        return entry | measured
