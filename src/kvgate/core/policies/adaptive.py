"""`adaptive`: kvgate's policy. Admission by predicted KV cost, per node, with feedback.

Two layers, so that safety never depends on a control loop that runs at sample rate:

1. **Deterministic ceilings, per node, at admission time.** A request of priority q may go
   to node n only if n is fresh or lagging (`core.nodes`), not thrashing, not in the
   panic state, and `predicted_tokens(n) + reservation <= ceiling(q) * capacity(n)`, where
   ceiling(sheddable) = high watermark, ceiling(standard) = `standard_ceiling` (midway to
   panic by default) and ceiling(critical) = panic watermark. Predicted tokens include
   every reservation the engine cannot reflect yet (see `policies.base`), and the
   reservation is taken at once, so no burst, however dense, pushes a node past panic.
   Among the nodes that fit, the one with the most headroom wins (power of two choices
   from `p2c_min_nodes` candidates on, falling back to a full scan when neither fits).
   Nodes are never averaged: one node at 99 % and one at 10 % are two different answers.

2. **Feedback between the watermarks, per node** (`limits.PidLimit`, one per node, updated
   on its samples, at most every `control_interval_s`). It measures the node's predicted
   usage and holds it at the high watermark by raising a pressure 0..1. The pressure
   (a) lowers the node's ceiling for non-critical work from `standard_ceiling` towards
   the high watermark (the node's token budget) and (b) sets shedding probabilities for
   requests routed to that node:
   sheddable `min(1, 2p)`, standard `max(0, 2p - 1)`, critical never. Requests are routed
   first and then face the pressure of the node they would land on, so a busy node never
   causes shedding of traffic a calm node can take. Draws come from a seeded
   `random.Random`: simultaneous requests are independent and runs reproducible.

3. **Large requests are not starved by lock-step retries** (`large_retry_spread`, on).
   There is no queue: a refused request retries after its Retry-After. A request needing
   at least `large_request_fraction` of a node (a long prompt on a small KV cache) that is
   refused for lack of room is usually one of a burst of such requests; all of them used
   to be told the same 1-2 s, came back together, and most used up their tries before
   room for them was freed. Their Retry-After is now drawn uniformly between the normal
   value and the time the cluster needs, at its measured freeing rate, to free the large
   tokens refused over the last second or so (each waiter retries about once a second,
   so that is the backlog). A lone large request is told little more than before.

4. **Claims** (`claims`, off by default: in the virtual benchmark they cost short
   requests more than they gave long ones; see `benchmarks/long_request_fairness/`).
   A large request refused for lack of room (`kv_high_watermark`, `budget`, `claimed`,
   or `kv_panic` as far as some node is not at panic; never thrashing or staleness)
   leaves a *claim* for its size on the usable node with the most room, at most one
   claim per node, binding from `claim_lead_s` before its Retry-After ends and expiring
   `claim_grace_s` after. While a claim binds, a smaller request (below
   `claim_use_fraction` of it, of the same or a lower priority) must leave the claimed
   tokens free on that node; a request at least that large may use the room and ends
   the claim when admitted there. Claims only ever make admission stricter: they are not
   reservations, never enter predicted usage, and the large request itself still passes
   the normal ceiling check, so the panic guarantee is untouched.

Refusals (`Reject.reason`, also the `X-Kvgate-Reason` header):
  * 429 `kv_high_watermark` - shed by the controller's draw, or no node fits under the
    priority's ceiling while none is at panic;
  * 429 `budget` - it would fit under the static ceiling, but the controller has lowered
    the node's ceiling (its token budget);
  * 429 `claimed` - the request would fit, but only in room claimed by a larger one;
  * 429 `kv_panic` - every node is at (or would pass) the panic watermark;
  * 429 `thrashing` - every fresh candidate is thrashing;
  * 503 `no_fresh_node` - no candidate is fresh or lagging (fail-closed);
  * 503 `no_capacity` - the request is larger than any candidate could ever hold;
  * 503 `no_backend` - the candidate list is empty.
Retry-After comes from `retry_after.py`: tokens to free over the measured freeing rate.
A refusal scan over many nodes is remembered until anything changes (sample, ticket,
node set) or a node it counted as fresh goes stale, so a refusal storm between two
samples costs O(1) per request.

Fail mode, when no candidate node is fresh: `closed` (default) answers 503 `no_fresh_node`
with a Retry-After of about one staleness period and never sends traffic to nodes nobody
has heard from; `open` sends the request to the candidate heard from most recently (or
round-robin among never-heard ones), without KV checks, still reserving and releasing.

Nodes with no KV gauge and no known capacity (llama.cpp without `default_capacity_tokens`)
take requests while their last sample shows nothing waiting and they are not thrashing;
they rank behind any node with measurable headroom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.core.admission import Reject
from kvgate.core.clock import Clock
from kvgate.core.limits import GradientLimit, LimitMeasurement, PidLimit, TokenLimit
from kvgate.core.nodes import LEVEL_PANIC, NodeState
from kvgate.core.policies.base import BasePolicy
from kvgate.core.rates import DecayingRate
from kvgate.core.request import Priority, RequestCost
from kvgate.core.reservations import ReservationStore
from kvgate.core.settings import AdmissionSettings

# Headroom score of a queue-gated node (no capacity known): behind any measurable headroom.
_UNKNOWN_HEADROOM = -1.0
# Candidate lists whose last scan is remembered (one per model and priority in practice).
_SCAN_CACHE_SIZE = 256
_SHED_MESSAGES = {
    q: f"The KV cache is above its target; {q.name.lower()} requests are being shed. Retry later."
    for q in Priority
}


class _Claim:
    """Room on one node held free for a request class of about `tokens` (see "Claims")."""

    __slots__ = ("binds_at", "expires", "priority", "tokens")

    def __init__(self, tokens: int, binds_at: float, expires: float, priority: Priority) -> None:
        self.tokens = tokens
        self.binds_at = binds_at
        self.expires = expires
        self.priority = priority


class _Scan:
    """A full pass over one candidate list; reused for refusals until anything changes.

    Valid while the policy's generation is unchanged (no sample, ticket or node-set change)
    and no fresh node has gone stale (`valid_until`); a node going stale can only remove
    room, but it can change the reason (no fresh node at all), hence the expiry.
    """

    __slots__ = (
        "at_panic",
        "best",
        "fresh",
        "generation",
        "max_capacity",
        "max_free",
        "max_panic_room",
        "max_room",
        "max_static_room",
        "unknown_capacity",
        "usable",
        "valid_until",
    )

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.best: NodeState | None = None
        self.fresh = 0
        self.usable = 0
        self.unknown_capacity = 0
        self.max_capacity = 0
        self.max_room = float("-inf")  # ignoring claims: an upper bound for any request
        self.max_free = float("-inf")  # after the claims that bind this scan's request
        self.max_static_room = float("-inf")
        self.max_panic_room = float("-inf")
        self.at_panic = False
        self.valid_until = float("inf")


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
        self._new_limit = limit_factory or self._default_limit
        self.limits: dict[str, TokenLimit] = {}
        self._controlled_at: dict[str, float] = {}
        self._scans: dict[tuple[Priority, tuple[str, ...]], _Scan] = {}
        self._claims: dict[str, _Claim] = {}
        self._large_refused = DecayingRate(1.0)
        self._ceilings = {
            Priority.SHEDDABLE: settings.high_watermark,
            Priority.STANDARD: settings.standard_ceiling_value,
            Priority.CRITICAL: settings.panic_watermark,
        }

    def _default_limit(self) -> TokenLimit:
        s = self.settings
        if s.controller == "gradient":
            return GradientLimit(s.high_watermark, s.panic_watermark)
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
        settings = self.settings
        need = cost.prompt_tokens + cost.max_output_tokens + settings.reservation_overhead_tokens
        if len(candidates) >= settings.p2c_min_nodes:
            node = self._two_choices(now, candidates, need, priority)
            if node is not None:
                return self._admit_or_shed(now, node, priority, need)
        key = (priority, tuple(candidates))
        scan = self._scans.get(key)
        if (
            scan is not None
            and scan.generation == self.generation
            and now < scan.valid_until
            and need > scan.max_room  # claims cannot make it fit: max_room ignores them
        ):
            return self._refuse(now, candidates, scan, need, priority)  # nothing changed
        scan = self._scan(now, candidates, need, priority)
        if len(self._scans) >= _SCAN_CACHE_SIZE:
            self._scans.clear()
        self._scans[key] = scan
        if scan.best is not None:
            return self._admit_or_shed(now, scan.best, priority, need)
        return self._refuse(now, candidates, scan, need, priority)

    def _room(self, node: NodeState, now: float, priority: Priority) -> float | None:
        """Tokens `node` can still take under the priority's ceiling; None when unusable.

        Unusable: neither fresh nor lagging (`core.nodes`), thrashing, or in the panic
        state. A node with no known capacity has unbounded room while nothing waits on it,
        and none otherwise.
        """
        sample = node.sample
        settings = self.settings
        if (
            sample is None
            or node.thrashing
            or node.level == LEVEL_PANIC
            or now > node.live_until(settings)  # neither fresh nor lagging
        ):
            return None
        cap = node.cap
        if cap is None:
            return float("inf") if sample.waiting == 0 else None
        ceiling = self._ceilings[priority]
        if priority is not Priority.CRITICAL and node.dynamic_ceiling < ceiling:
            ceiling = node.dynamic_ceiling
        return ceiling * cap - node.used - self.store.reserved(node.node_id)

    def _two_choices(
        self, now: float, candidates: Sequence[str], need: int, priority: Priority
    ) -> NodeState | None:
        """The better of two random candidates that fit: the most headroom fraction left
        after `need`; queue-gated nodes (no known capacity) rank behind measured ones."""
        n = len(candidates)
        randrange = self.rng.randrange
        i = randrange(n)
        j = randrange(n - 1)
        best: NodeState | None = None
        best_score = float("-inf")
        for node_id in (candidates[i], candidates[j + (j >= i)]):
            node = self.nodes.get(node_id)
            if node is None:
                continue
            room = self._room(node, now, priority)
            if room is None:
                continue
            if self._claims:
                room -= self._held_from(node_id, now, need, priority)
            if room < need:
                continue
            cap = node.cap
            score = _UNKNOWN_HEADROOM if cap is None else (room - need) / cap
            if score > best_score:
                best, best_score = node, score
        return best

    def _scan(self, now: float, candidates: Sequence[str], need: int, priority: Priority) -> _Scan:
        """One pass over the candidates: the best node for `need` and why others refuse.

        The same rules as `_room`, inlined with locals: this loop is the worst case of a
        refusal (every node full, a new sample since the last scan).
        """
        scan = _Scan(self.generation)
        settings = self.settings
        panic = settings.panic_watermark
        stale_after = settings.stale_after_s
        failures_to_stale = settings.failures_to_stale
        static = self._ceilings[priority]
        critical = priority is Priority.CRITICAL
        nodes_get = self.nodes.get
        reserved = self.store.reserved
        claims = self._claims
        use_fraction = settings.claim_use_fraction
        inf = float("inf")
        fresh = usable = unknown = max_capacity = 0
        valid_until = inf
        max_panic_room = -inf
        max_room = max_free = max_static_room = best_score = -inf
        measured = in_panic_count = 0
        best: NodeState | None = None
        for node_id in candidates:
            node = nodes_get(node_id)
            if node is None:
                continue
            sample = node.sample
            if sample is None:
                continue
            expires = sample.sampled_at + stale_after
            if now > expires or node.consecutive_failures >= failures_to_stale:
                expires = node.live_until(settings)  # lagging: it is seen serving
                if now > expires:
                    continue
            fresh += 1
            if expires < valid_until:
                valid_until = expires
            if node.thrashing:
                continue
            usable += 1
            cap = node.cap
            in_panic = node.level == LEVEL_PANIC
            if cap is None:
                unknown += 1
                if in_panic or sample.waiting:
                    continue
                room = free = inf
                score = _UNKNOWN_HEADROOM
            else:
                if cap > max_capacity:
                    max_capacity = cap
                predicted = node.used + reserved(node_id)
                panic_room = panic * cap - predicted
                if panic_room > max_panic_room:
                    max_panic_room = panic_room
                measured += 1
                if in_panic:
                    in_panic_count += 1
                    continue
                static_room = static * cap - predicted
                if static_room > max_static_room:
                    max_static_room = static_room
                ceiling = node.dynamic_ceiling
                if critical or ceiling > static:
                    ceiling = static
                room = free = ceiling * cap - predicted
                claim = claims.get(node_id) if claims else None
                if (
                    claim is not None
                    and claim.binds_at <= now < claim.expires
                    and need < use_fraction * claim.tokens
                    and priority >= claim.priority
                ):
                    free -= claim.tokens
                score = (free - need) / cap
            if room > max_room:
                max_room = room
            if free > max_free:
                max_free = free
            if free >= need and score > best_score:
                best, best_score = node, score
        scan.best = best
        scan.fresh, scan.usable, scan.unknown_capacity = fresh, usable, unknown
        # "At panic" describes the cluster only when every measured node is there: one hot
        # node among calm ones is a routing matter, not a panic.
        at_panic = measured > 0 and in_panic_count == measured
        scan.max_capacity, scan.valid_until, scan.at_panic = max_capacity, valid_until, at_panic
        scan.max_room, scan.max_free, scan.max_static_room = max_room, max_free, max_static_room
        scan.max_panic_room = max_panic_room
        return scan

    def _admit_or_shed(
        self, now: float, node: NodeState, priority: Priority, need: int
    ) -> str | Reject:
        node_id = node.node_id
        if priority is not Priority.CRITICAL:  # `_shed_probability`, inlined
            limit = self.limits.get(node_id)
            if limit is not None:
                pressure = limit.pressure
                if priority is Priority.SHEDDABLE:
                    probability = min(1.0, 2.0 * pressure)
                else:
                    probability = max(0.0, 2.0 * pressure - 1.0)
                if probability > 0 and self.rng.random() < probability:
                    return self._controller_shed(now, node, limit, priority, need)
        claims = self._claims
        if claims:
            claim = claims.get(node_id)
            if claim is not None and need >= self.settings.claim_use_fraction * claim.tokens:
                del claims[node_id]  # the class it held room for got in
        return node_id

    def _refuse(
        self, now: float, candidates: Sequence[str], scan: _Scan, need: int, priority: Priority
    ) -> str | Reject:
        if scan.fresh == 0:
            return self._no_fresh(now, candidates)
        if scan.usable == 0:
            return self.reject_shed(
                "thrashing",
                "Every backend for this model is thrashing (preempting); retry later.",
                now,
                need,
            )
        panic = self.settings.panic_watermark
        if scan.unknown_capacity == 0 and need > panic * scan.max_capacity:
            return self._reject_unavailable(
                "no_capacity",
                f"This request may hold {need} KV tokens, more than any backend can hold;"
                " lower max_tokens or shorten the prompt.",
                now,
                retry_s=self.settings.retry_after_max_s,
            )
        if need <= scan.max_room:  # it fits somewhere, but only in room claimed by a larger one
            reject = self.reject_shed(
                "claimed",
                "The free KV room is held for a larger request that was refused earlier;"
                " retry later.",
                now,
                max(need - scan.max_free, 0.0),
            )
            return self._wait_large(now, candidates, scan, need, priority, reject)
        excess = need - scan.max_room if scan.max_room > float("-inf") else float(need)
        if priority is Priority.CRITICAL or scan.at_panic or need > scan.max_panic_room:
            reason, what = "kv_panic", "at its panic watermark"
        elif need <= scan.max_static_room:
            reject = self.reject_shed(
                "budget",
                "The KV cache is above its target and the controller has lowered the token"
                f" budget for {priority.name.lower()} requests; retry later.",
                now,
                max(excess, 0.0),
            )
            return self._wait_large(now, candidates, scan, need, priority, reject)
        else:
            reason, what = "kv_high_watermark", "above its high watermark"
        reject = self.reject_shed(
            reason,
            f"The KV cache of every backend for this model is {what}"
            f" for {priority.name.lower()} requests; retry later.",
            now,
            max(excess, 0.0),
        )
        # Also after `kv_panic`: that reason only says the request would pass panic on *some*
        # node; `_stake` itself skips nodes that are at panic, thrashing or stale.
        return self._wait_large(now, candidates, scan, need, priority, reject)

    # --- claims -------------------------------------------------------------------------------

    def _held_from(self, node_id: str, now: float, need: int, priority: Priority) -> int:
        """Tokens a request of `need` must leave free on `node_id` for an active claim."""
        claim = self._claims.get(node_id)
        if (
            claim is None
            or not claim.binds_at <= now < claim.expires
            or need >= self.settings.claim_use_fraction * claim.tokens
            or priority < claim.priority
        ):
            return 0
        return claim.tokens

    def _wait_large(
        self,
        now: float,
        candidates: Sequence[str],
        scan: _Scan,
        need: int,
        priority: Priority,
        reject: Reject,
    ) -> Reject:
        """A large request refused for lack of room: spread its retry, maybe stake a claim."""
        settings = self.settings
        if scan.max_capacity == 0 or need < settings.large_request_fraction * scan.max_capacity:
            return reject
        if settings.large_retry_spread:
            reject = self._spread(now, need, reject)
        if settings.claims:
            self._stake(now, candidates, need, priority, reject.retry_after_s)
        return reject

    def _stake(
        self,
        now: float,
        candidates: Sequence[str],
        need: int,
        priority: Priority,
        retry_after_s: float,
    ) -> None:
        """After a refusal for lack of room, claim `need` tokens where it came closest.

        A claim this request may use (same size class) is renewed rather than a second one
        made; otherwise the unclaimed usable node with the most room gets a new claim. Nodes
        whose claim belongs to another size class are left alone (one claim per node).
        """
        settings = self.settings
        renew: str | None = None
        fresh: str | None = None
        renew_room = fresh_room = float("-inf")
        large = settings.large_request_fraction
        for node_id in candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None or need < large * node.cap:
                continue
            room = self._room(node, now, priority)
            if room is None:
                continue  # stale, thrashing or at panic: not a place to wait for
            claim = self._claims.get(node_id)
            if claim is None or now >= claim.expires:
                if room > fresh_room:
                    fresh, fresh_room = node_id, room
            elif need >= settings.claim_use_fraction * claim.tokens and room > renew_room:
                renew, renew_room = node_id, room
        expires = now + retry_after_s + settings.claim_grace_s
        binds_at = now + max(0.0, retry_after_s - settings.claim_lead_s)
        if renew is not None:
            claim = self._claims[renew]
            claim.tokens = max(claim.tokens, need)
            claim.binds_at = min(claim.binds_at, binds_at)
            claim.expires = max(claim.expires, expires)
            claim.priority = min(claim.priority, priority)
        elif fresh is not None:
            self._claims[fresh] = _Claim(need, binds_at, expires, priority)

    def _spread(self, now: float, need: int, reject: Reject) -> Reject:
        """Spread the retries of large requests over the time their backlog takes to drain.

        Every large request refused in a burst would otherwise be told about the same 1-2 s
        and come back together, so most of them use up their tries before the node has freed
        room for them. The backlog is estimated from the large tokens refused over the last
        ~second (each waiter retries about once a second); each refusal draws its delay
        uniformly between the normal Retry-After and the backlog's drain time.
        """
        self._large_refused.add(now, need)
        freed = self.freed_tokens_per_s(now)
        if freed <= 0:
            return reject
        drain = self._large_refused.value(now) / freed
        low = reject.retry_after_s
        high = min(self.settings.retry_after_max_s, max(low, drain))
        if high <= low:
            return reject
        return dataclasses.replace(reject, retry_after_s=self.rng.uniform(low, high))

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
        """The controller's draw for a request routed to `node`: a refusal, or None."""
        probability = self._shed_probability(node.node_id, priority)
        if probability > 0 and self.rng.random() < probability:
            return self._controller_shed(now, node, self.limits[node.node_id], priority, need)
        return None

    def _controller_shed(
        self, now: float, node: NodeState, limit: TokenLimit, priority: Priority, need: int
    ) -> Reject:
        excess: float = need
        predicted = self.predicted_tokens(node)
        if node.cap is not None and predicted is not None:
            excess += max(0.0, predicted - limit.setpoint * node.cap)
        return self.reject_shed("kv_high_watermark", _SHED_MESSAGES[priority], now, excess)

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

    # --- control loop -------------------------------------------------------------------------

    def _on_observe(self, now: float, node: NodeState) -> None:
        capacity = node.capacity(self.settings)
        predicted = self.predicted_tokens(node)
        if capacity is None or predicted is None:
            return
        limit = self.limits.get(node.node_id)
        if limit is None:
            limit = self.limits[node.node_id] = self._new_limit()
        last = self._controlled_at.get(node.node_id)
        if last is not None and now - last < self.settings.control_interval_s:
            return  # fast scrapes or pushes: the loop keeps its own pace
        self._controlled_at[node.node_id] = now
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
        node.dynamic_ceiling = limit.ceiling

    def remove_node(self, node_id: str) -> None:
        super().remove_node(node_id)
        self.limits.pop(node_id, None)
        self._controlled_at.pop(node_id, None)
        self._claims.pop(node_id, None)

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
            "limit": self.settings.controller,
        }

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = super()._node_snapshot(now, node)
        limit = self.limits.get(node.node_id)
        entry["pressure"] = 0.0 if limit is None else limit.pressure
        entry["budget_tokens"] = None if limit is None else limit.budget_tokens
        claim = self._claims.get(node.node_id)
        if claim is not None and now < claim.expires:
            entry["claimed_tokens"] = claim.tokens
            entry["claim_expires_in_s"] = claim.expires - now
        else:
            entry["claimed_tokens"] = 0
            entry["claim_expires_in_s"] = None
        return entry
