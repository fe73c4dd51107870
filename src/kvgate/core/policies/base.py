"""What every placement policy shares: a composition of the per-node plan and the claims.

`BasePolicy` implements the flow controller's contract (`kvgate.core.admission
.AdmissionPolicy`) around a subclass's `_decide`, and composes one part per idea:

- `nodes`: what each engine last said about itself (`kvgate.core.nodes`);
- `holds`: each admitted request's hold and its reflection in samples
  (`kvgate.core.plan.holds`);
- `pace`: seconds per token on each node (`kvgate.core.plan.pace`);
- `forecast`: each node's envelope, built from the holds, the other replicas' requests and
  what ended unseen, and the drain and start predictions made from it
  (`kvgate.core.plan.forecast`);
- `claims`: this replica's claims on each node's slack while other replicas admit too
  (`kvgate.core.replicas.claims`);
- `lengths`: the expected output length per model (`kvgate.core.plan.lengths`);
- `sharing`: the prompt blocks the holds on each node share, counted once
  (`kvgate.core.prefix.held`): a request whose prompt's leading blocks a running request
  on the node holds already costs that node only the rest (`sharing.on`), a request
  whose ids come after it started takes its share then (`recount`), and a shared block
  passes to the holder expected to end last when its owner ends.

Here only the lifecycle of a ticket is wired through them (`admit`, `on_first_token`,
`on_tokens`, `release`, `observe`), with what the baselines share: routing to the least
loaded node and refusals whose Retry-After comes from the measured freeing rate.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

from kvgate.core.admission import Admit, Decision, Outcome, Reject, StartEstimate, Ticket
from kvgate.core.clock import Clock
from kvgate.core.nodes import NodeState, next_level
from kvgate.core.plan.forecast import Forecast
from kvgate.core.plan.holds import Holds
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.plan.pace import Pace
from kvgate.core.prefix.held import PromptBlocks, PromptSharing
from kvgate.core.replicas.claims import Claims
from kvgate.core.replicas.peers import PeerState
from kvgate.core.request import AdmissionRequest
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered, retry_after
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample


class BasePolicy:
    """Shared machinery; subclasses implement `_decide` (and optionally the hooks)."""

    name = "base"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        self.settings = settings
        self.tuning = settings.tuning
        self.clock = clock
        # Routing and jitter draw from here: seeded by the simulator and the benchmarks, so
        # that a run reproduces; a gateway passes None and draws OS entropy once, here.
        self.rng = random.Random(rng_seed)
        self.lengths = lengths if lengths is not None else OutputLengths()
        self.nodes: dict[str, NodeState] = {}
        self.holds = Holds(self.tuning)
        self.pace = Pace(self.nodes)
        self.forecast = Forecast(settings, clock, self.holds, self.pace)
        self.prompt_blocks = PromptBlocks()
        # Each node's KV block size, where its engine caches prefixes (`sample.block_size`).
        self.block_sizes: dict[str, int] = {}
        self.sharing = PromptSharing(self.block_sizes, self.prompt_blocks)
        self.claims = Claims(settings, self.nodes, self.holds, self.forecast, self.sharing)
        self._seq = itertools.count()
        self._rr = 0
        # Bumped whenever anything a decision depends on changes (sample, ticket, node set,
        # peers), so a policy may cache a "nothing fits" scan until the next change.
        self.generation = 0

    # --- the AdmissionPolicy contract ------------------------------------------------------

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        now = self.clock.now()
        if not request.candidates:
            return self._reject_unavailable(
                "no_backend", "No backend serves this model.", now, retry_s=1.0
            )
        expected = self.lengths.expected(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        choice = self._decide(now, request, expected, promised or {})
        if isinstance(choice, Reject):
            return choice
        return Admit(self._open(now, request, choice, expected))

    def start_estimate(self, request: AdmissionRequest) -> StartEstimate | None:
        return None

    def shortfall(self, request: AdmissionRequest) -> float:
        """Tokens the candidates must free before `request` fits on the best of them (its
        own size when nothing more precise is known)."""
        return float(request.cost.total)

    def drain_time(
        self, tokens: float, candidates: Sequence[str], fastest: bool = False
    ) -> float | None:
        """When the candidates will have freed `tokens` (`Forecast.drain_time`)."""
        return self.forecast.drain_time(tokens, tuple(candidates), self.generation, fastest)

    def measured(self, request: AdmissionRequest) -> bool:
        """Do predictions on the request's candidates rest on measurements alone
        (`Forecast.measured`)? Only the candidates a prediction may name count: those
        whose capacity is known and that are live or only late."""
        now = self.clock.now()
        cost = request.cost
        informed = self.lengths.informed(
            request.model, cost.max_output_tokens, request.exact_output
        )
        for node_id in request.candidates:
            node = self.nodes.get(node_id)
            if node is None or node.cap is None:
                continue
            if not node.is_live(now, self.settings) and not node.is_late(now, self.settings):
                continue
            if not self.forecast.measured(node_id, informed):
                return False
        return True

    def time_left(self, ticket: Ticket, fastest: bool = False) -> float:
        """Seconds until the ticket's request is expected to end (0 once released);
        `fastest`: at its node's fastest pace."""
        hold = self.holds.live.get(ticket.key)
        return 0.0 if hold is None else self.forecast.time_left(hold, fastest)

    def footprint(self, request: AdmissionRequest, expected: int) -> int:
        """Tokens the request will hold at its end if it runs as expected."""
        return request.cost.prompt_tokens + expected + self.tuning.reservation_overhead_tokens

    def recount(self, ticket: Ticket, request: AdmissionRequest) -> None:
        """The admitted ticket's prompt was counted after it started: `request` is its copy
        with the count (and, for one prompt, its ids). Its hold takes the count less the
        blocks other holds on its node hold, and owns the rest for the requests after it.
        Nothing changes once it ended, or where it was admitted with its ids."""
        hold = self.holds.live.get(ticket.key)
        if hold is None or ticket.request.prompt_ids:
            return
        before = ticket.request.cost.prompt_tokens
        ticket.request = request
        shared = self.sharing.take(ticket.key, hold.node_id, request.prompt_ids)
        self.holds.recount(hold, before, request.cost.prompt_tokens, shared)
        self.generation += 1
        self._refresh_level(hold.node_id)

    def on_first_token(self, ticket: Ticket) -> None:
        if ticket.first_token_at is None:
            ticket.first_token_at = self.clock.now()
        hold = self.holds.live.get(ticket.key)
        if hold is not None:
            node = self.nodes.get(hold.node_id)
            if node is not None:
                node.progress(ticket.first_token_at)
            self.holds.first_token(hold, ticket.first_token_at)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        now = self.clock.now()
        holds = self.holds
        hold = holds.live.get(ticket.key)
        if ticket.first_token_at is None:
            ticket.first_token_at = now
            if hold is not None:
                holds.first_token(hold, now)
        if hold is None or output_tokens <= hold.tok_cur:
            return
        node_id = hold.node_id
        node = self.nodes.get(node_id)
        if node is not None:
            node.progress(now)
        output_tokens = min(output_tokens, hold.max_out)  # past it: stream framing, no KV
        if output_tokens <= hold.tok_cur:
            return
        ticket.output_tokens = output_tokens
        book = holds.books[node_id]
        self.forecast.progressed(hold, book, output_tokens)
        pace = holds.grow(hold, book, output_tokens, now)
        if pace is not None:
            self.pace.record(node_id, now, pace)

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.released:
            return
        ticket.released = True
        live = self.holds.live
        source = live.get(ticket.key)
        if source is not None and ticket.request.prompt_ids:
            heirs = self.sharing.drop(ticket.key, source.node_id, lambda k: live[k].remaining())
            for heir, tokens in heirs.items():
                self.holds.transfer(source, live[heir], tokens)
        hold = self.holds.release(ticket.key)
        if hold is None:
            return
        node_id = hold.node_id
        self.forecast.released(node_id)
        self.generation += 1
        now = self.clock.now()
        node = self.nodes.get(node_id)
        if node is not None:
            node.freed_unseen += hold.reflected  # freed now (`Forecast.used`)
        self._refresh_level(node_id)
        self.forecast.freed.add(now, hold.full)
        if outcome is Outcome.DONE:
            request = ticket.request
            produced = max(ticket.output_tokens, hold.tok_cur)
            self.lengths.learn(request.model, request.cost.max_output_tokens, produced)

    def observe(self, node_id: str, sample: NodeSample) -> None:
        now = self.clock.now()
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        self._before_observe(node)
        decoding = self.holds.prefill_backlog(node_id) == 0
        if not node.accept(sample, now, self.settings, decoding):
            return
        self.generation += 1
        if sample.block_size:
            # The engine caches blocks of this size (holds keep the hashes they opened with).
            self.block_sizes[node_id] = sample.block_size
        book = self.holds.books.get(node_id)
        self.forecast.observed(node_id, book)
        if book is not None:
            self.holds.reflect(book, sample)
        self._refresh_level(node_id)
        self._on_observe(now, node)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        node.fail(hard)
        self.generation += 1

    def add_node(self, node_id: str) -> None:
        if node_id not in self.nodes:
            self.nodes[node_id] = NodeState(node_id)
            self.generation += 1

    def remove_node(self, node_id: str) -> None:
        """Forget the node's state; its live tickets stay held until the shell releases them."""
        self.nodes.pop(node_id, None)
        self.pace.forget(node_id)
        self.forecast.forget(node_id)
        self.generation += 1

    def set_peers(self, state: PeerState) -> None:
        """The other replicas' state from the last sync (`Claims.set_peers`)."""
        self.claims.set_peers(state)
        self.sharing.set_peers({node_id: p.marks for node_id, p in state.nodes.items()})
        self.generation += 1

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.now()
        return {
            "policy": self.name,
            "time": now,
            "nodes": {nid: self._node_snapshot(now, node) for nid, node in self.nodes.items()},
            "controller": self._controller_snapshot(now),
            "in_flight_requests": len(self.holds.live),
            "released_tokens_per_s": self.forecast.freed.value(now),
            "expected_output": self.lengths.snapshot(),
        }

    # --- for subclasses ---------------------------------------------------------------------

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        raise NotImplementedError

    def _before_observe(self, node: NodeState) -> None:
        """Called before a new sample of the node is taken (the last plan still stands)."""

    def _on_observe(self, now: float, node: NodeState) -> None:
        """Called after a new sample was accepted and reflected."""

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        return {
            "in_flight_tokens": self.holds.tokens,
            "high_watermark": self.settings.high_watermark,
            "panic_watermark": self.settings.panic_watermark,
        }

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = node.snapshot(now, self.settings)
        entry["reserved_tokens"] = self.holds.reserved_on(node.node_id)
        entry["in_flight"] = self.holds.in_flight_on(node.node_id)
        entry["predicted_usage"] = self.forecast.usage_now(node)
        # The pace the forecast turns steps into seconds with, and whether it is measured
        # (a prediction on the prior never refuses a request).
        entry["pace_s"] = self.pace.step_s(node.node_id)
        entry["pace_fastest_s"] = self.pace.fastest_step_s(node.node_id)
        entry["pace_measured"] = self.pace.measured(node.node_id)
        sample = node.sample
        if (
            sample is not None
            and sample.prefix_queries_total
            and sample.prefix_hits_total is not None
        ):
            # The engine's own prefix cache hit rate since it started.
            entry["prefix_hit_rate_seen"] = sample.prefix_hits_total / sample.prefix_queries_total
        return entry

    # --- what the baselines share -------------------------------------------------------------

    @property
    def in_flight_requests(self) -> int:
        return len(self.holds.live)

    @property
    def in_flight_tokens(self) -> int:
        return self.holds.tokens

    def least_loaded(self, candidates: Sequence[str]) -> str:
        """Fewest live tickets; ties broken round-robin so equal nodes share the load.

        From `p2c_min_nodes` candidates on: the less loaded of two random ones (O(1)).
        """
        n = len(candidates)
        in_flight_on = self.holds.in_flight_on
        if n >= self.tuning.p2c_min_nodes:
            i = self.rng.randrange(n)
            j = self.rng.randrange(n - 1)
            a, b = candidates[i], candidates[j + (j >= i)]
            return a if in_flight_on(a) <= in_flight_on(b) else b
        self._rr = (self._rr + 1) % n
        best = candidates[self._rr]
        best_load = in_flight_on(best)
        for i in range(1, n):
            cand = candidates[(self._rr + i) % n]
            load = in_flight_on(cand)
            if load < best_load:
                best, best_load = cand, load
        return best

    def reject_shed(
        self, reason: str, message: str, now: float, excess_tokens: float, waitable: bool = False
    ) -> Reject:
        """429: shed now, come back after the cluster has freed `excess_tokens`."""
        rate = self.forecast.freed.value(now)
        delay = retry_after(excess_tokens, rate, MAX_RETRY_AFTER_S, self.rng)
        return Reject(429, reason, delay, message, waitable)

    def _reject_unavailable(
        self, reason: str, message: str, now: float, retry_s: float | None = None
    ) -> Reject:
        """503: no backend can serve at all; retry after about one staleness period."""
        centre = retry_s if retry_s is not None else max(1.0, self.settings.stale_after_s)
        centre = min(max(1.0, centre), MAX_RETRY_AFTER_S)
        delay = jittered(centre, self.rng, MAX_RETRY_AFTER_S)
        return Reject(status=503, reason=reason, retry_after_s=delay, message=message)

    # --- wiring -------------------------------------------------------------------------------

    def _open(
        self, now: float, request: AdmissionRequest, node_id: str, expected: int, cached: int = 0
    ) -> Ticket:
        """Open the ticket and its hold; `cached`: prompt tokens the node's engine is
        expected to have cached (they need no prefill)."""
        key = f"{next(self._seq)}:{request.request_id}"
        ticket = Ticket(
            request=request, node_id=node_id, admitted_at=now, key=key, expected_output=expected
        )
        cost, model, exact = request.cost, request.model, request.exact_output
        guessed = not self.lengths.informed(model, cost.max_output_tokens, exact)
        likely = self.lengths.likely(model, cost.max_output_tokens, exact)
        shared = self.sharing.take(key, node_id, request.prompt_ids)
        hold = self.holds.open(ticket, guessed, likely, shared, cached)
        self.forecast.opened(hold)
        if node_id in self.claims.left:
            self.claims.spend(node_id, self.footprint(request, expected))
        self.generation += 1
        self._refresh_level(node_id)
        return ticket

    def _refresh_level(self, node_id: str) -> None:
        """Move the node's watermark state (with hysteresis) after its usage changed."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        usage = self.forecast.usage_now(node)
        if usage is None:
            return
        s = self.settings
        node.level = next_level(
            node.level, usage, s.high_watermark, s.panic_watermark, self.tuning.hysteresis
        )
