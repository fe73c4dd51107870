"""Virtual-time mode: a cluster of engine models behind kvgate admission, no HTTP, no sleep.

A discrete-event loop (one heap, ties broken by insertion order, so a run is a pure
function of its `VirtualConfig`) advances a `ManualClock` from event to event:

- **Engines** step back to back while they have work: at each step boundary the previous
  step is finished (tokens, finishes, frees) and the next one begins. With
  `VirtualConfig.kv_events`, each step's KV events go at its end, as one numbered batch
  per engine, to every replica's policy that takes them (`KVEventSink`) and to `kv_sink`:
  to each replica as published, or through the owner's view (`kvgate.sim.kv_fanout`).
- **Gateway replicas** each hold their own policy (`VirtualConfig.policy`), so each
  knows only its own reservations, like real replicas. Each scrapes every engine every
  `scrape_interval_s` (replicas spread over the interval); the page is taken at the send
  time and reaches the policy `scrape_lag_s` later, stamped with the send time as the
  holds' reflection asks (`kvgate.core.plan.holds`). With `sync_interval_s` they exchange
  their views (`PeerView`) through a modelled store, as live replicas do through Redis.
  Streaming requests report their output count to their replica
  every `token_update_interval_s` (what a live gateway learns from the stream; coarser
  than per token to keep the cost O(streams) per update, never under-counting).
- **Clients** arrive from a `WorkloadSpec` (or a caller's own list of `RequestSpec`, which is
  how `kvgate.bench` plays its scenario, plus the `FollowUps` that answered requests lead
  to: a conversation's next turn) and behave as `ClientModel` says. A request's token ids,
  when it has them, go to its engine (prefix caching) and to the admission request. An admitted
  request goes to the node the policy chose. A client times out when the whole answer
  (`deadline="answer"`) or, for a stream with `deadline="token"`, the next token takes
  longer than `timeout_s`; it then disconnects and retries (at once or with exponential
  backoff). With `abort_on_disconnect=True` the engine drops the request at its next step
  and the replica frees its reservation; with `False` the request runs on as a zombie and,
  as in a gateway without cascading cancellation, the replica's upstream call (and its
  ticket) lives until the engine finishes it. A 429 waits for its Retry-After; a 503
  counts as a 5xx. `max_attempts`, `max_retries` and `max_429_tries` bound the tries.

The configuration (`VirtualConfig`) and the results are the plain dataclasses of
`kvgate.sim.runs`: one `RequestOutcome` per client
request holding one `Attempt` record per try (the records the benchmark scores, live or
virtual), and one `SeriesPoint` per `series_interval_s`, in a `VirtualResult`.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.flow import ArrivalOrder, FlowController, TokenFairness, Waiter
from kvgate.core.policies import AdaptivePolicy
from kvgate.core.policies.baselines import build_named
from kvgate.core.prefix.events import KVEventBatch, KVEventSink
from kvgate.core.replicas.view import PeerView
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.signals import NodeSample
from kvgate.sim.kv_fanout import KVFanOut, Sink
from kvgate.sim.model.engine import Engine, EngineError, StepResult
from kvgate.sim.runs import (
    ERROR,
    OK,
    SHED,
    TIMEOUT,
    UNAVAILABLE,
    Attempt,
    RequestOutcome,
    SeriesPoint,
    VirtualConfig,
    VirtualResult,
    engine_totals,
    scrape,
    series_point,
)
from kvgate.sim.workload import FollowUps, RequestSpec, generate

(_STEP, _ARRIVAL, _ATTEMPT, _SCRAPE, _DELIVER, _TIMEOUT, _SERIES, _DECIDED, _WAIT_END,
 _SYNC, _STORE, _REPLY, _KV) = range(13)  # fmt: skip
_PRIORITY_NAMES = {p: p.name.lower() for p in Priority}
# A client request as its tries see it: its outcome record, its spec and its cost.
_Request = tuple[RequestOutcome, RequestSpec, RequestCost]


class _Attempt:
    __slots__ = ("active", "gateway", "held", "node", "outcome", "record", "request", "rid",
                 "spec", "started", "ticket")  # fmt: skip

    def __init__(
        self,
        request: _Request,
        rid: str,
        node: int,
        gateway: int,
        ticket: Ticket,
        record: Attempt,
    ) -> None:
        self.request = request
        self.outcome, self.spec, _ = request
        self.rid = rid
        self.node = node
        self.gateway = gateway
        self.ticket = ticket
        self.record = record
        self.started = record.start
        self.active = True  # the client is still waiting for it
        self.held = False  # abandoned, but its ticket lives until the engine finishes it


class VirtualCluster:
    """Build with a config, call `run()` once."""

    def __init__(
        self,
        config: VirtualConfig,
        arrivals: Iterable[RequestSpec] | None = None,
        follow_ups: FollowUps | None = None,
        kv_sink: Callable[[str, KVEventBatch], None] | None = None,
    ) -> None:
        """`arrivals` (in arrival order) replaces the requests `config.workload` would draw;
        `follow_ups` adds the request that follows each answered one; `kv_sink` also
        receives every engine's KV event batches (with `config.kv_events`)."""
        if config.nodes < 1 or config.gateways < 1:
            raise ValueError("need at least one node and one gateway")
        self.config = config
        self._arrivals = arrivals
        self._follow_ups = follow_ups
        self.clock = ManualClock()
        self.node_ids = [f"node-{i}" for i in range(config.nodes)]
        self._node_index = {nid: i for i, nid in enumerate(self.node_ids)}
        self.engines = [Engine(config.engine, seed=config.seed * 1009 + i,
                               record_kv_events=config.kv_events)
                        for i in range(config.nodes)]  # fmt: skip
        self.policies: list[FlowController] = [
            self._gateway(config, g) for g in range(config.gateways)
        ]
        sinks = [flow.policy.kv_events if isinstance(flow.policy, KVEventSink) else None
                 for flow in self.policies]  # fmt: skip
        sync = None if config.sync_interval_s is None else (config.sync_interval_s,
                                                            config.store_latency_s)  # fmt: skip
        self._kv = KVFanOut(config.nodes, sinks, kv_sink,
                            lambda when, *kv: self._push(when, _KV, kv),
                            config.kv_events_via, sync)  # fmt: skip
        for policy in self.policies:
            for nid in self.node_ids:
                policy.add_node(nid)
        self._rng = random.Random(config.seed * 31 + 1)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._idle = [True] * config.nodes
        self._attempts: dict[str, _Attempt] = {}
        # Every attempt gets the same timeout, so deadlines arrive in admission order: a
        # deque swept by one heap event keeps the heap small (re-armed checks of streams
        # that are still producing tokens go through the heap individually).
        self._deadlines: deque[tuple[float, _Attempt]] = deque()
        self._sweep_armed = False
        # Streaming attempts with a first token, per (gateway, node): their counts are
        # reported to the replica before each sample it receives.
        self._streaming: list[list[dict[str, _Attempt]]] = [
            [{} for _ in range(config.nodes)] for _ in range(config.gateways)
        ]
        self._itl_seen = [[(0.0, 0)] * config.nodes for _ in range(config.gateways)]
        self._next_gateway = 0
        self._next_token_update = [0.0] * config.gateways
        self.outcomes: list[RequestOutcome] = []
        self.series: list[SeriesPoint] = []
        self._counts = dict.fromkeys(
            ("arrivals", "admissions", "rejections", "timeouts", "completions", "queued"), 0
        )
        self._candidates = tuple(self.node_ids)
        # Replica -> (published at, view): the shared store's contents.
        self._store: dict[int, tuple[float, PeerView]] = {}
        self._last_totals = (0, 0, 0)
        self._workload: Iterator[RequestSpec] = iter(())
        self._next_arrival: RequestSpec | None = None

    def _gateway(self, config: VirtualConfig, g: int) -> FlowController:
        policy = build_named(
            config.policy,
            config.admission,
            self.clock,
            rng_seed=config.seed * 7919 + g,
            options=config.baseline,
        )
        if isinstance(policy, AdaptivePolicy):
            policy.feedback = config.feedback
        name = f"gw-{g}"
        if config.order == "fcfs":
            return FlowController(
                policy, config.queue, fairness=ArrivalOrder(), strict=True, replica=name
            )
        return FlowController(policy, config.queue, fairness=TokenFairness(), replica=name)

    # ------------------------------------------------------------------ running
    def run(self) -> VirtualResult:
        cfg = self.config
        wall = time.perf_counter()
        # The run allocates millions of short-lived acyclic objects; the cyclic collector
        # would rescan the long-lived ones over and over (measured: ~2x slower with it).
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            events = self._loop()
        finally:
            if gc_was_enabled:
                gc.enable()
        horizon = cfg.duration_s + cfg.drain_s
        for attempt in self._attempts.values():
            if attempt.active:  # still open when the run ended: scored as a timeout
                attempt.record.end = horizon
                attempt.record.outcome = TIMEOUT
                attempt.record.output_tokens = self.engines[attempt.node].output_tokens(attempt.rid)
        for outcome in self.outcomes:
            if outcome.status == "pending":
                outcome.status = "unfinished"
        return VirtualResult(
            config=cfg,
            outcomes=self.outcomes,
            series=self.series,
            wall_s=time.perf_counter() - wall,
            events=events,
            engine_totals=engine_totals(self.engines),
        )

    def _loop(self) -> int:
        cfg = self.config
        if self._arrivals is not None:
            self._workload = iter(self._arrivals)
        else:
            self._workload = generate(
                cfg.workload, cfg.duration_s, cfg.seed, cfg.engine.max_model_len
            )
        self._push_next_arrival()
        for g in range(cfg.gateways):
            self._push(g * cfg.scrape_interval_s / cfg.gateways, _SCRAPE, g)
            if cfg.sync_interval_s is not None and cfg.gateways > 1:
                self._push(g * cfg.sync_interval_s / cfg.gateways, _SYNC, g)
        self._push(cfg.series_interval_s, _SERIES, None)
        end = cfg.duration_s + cfg.drain_s
        heap, pop, events = self._heap, heapq.heappop, 0
        handlers = (self._on_step, self._on_arrival, self._on_attempt, self._on_scrape,
                    self._on_deliver, self._on_timeout, self._on_series, self._on_decided,
                    self._on_wait_end, self._on_sync, self._on_store,
                    self._on_reply, self._on_kv)  # fmt: skip
        while heap and heap[0][0] <= end:
            now, _, kind, payload = pop(heap)
            self.clock.set(now)
            handlers[kind](now, payload)
            events += 1
        return events

    def _push(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, payload))

    # ------------------------------------------------------------------ clients
    def _push_next_arrival(self) -> None:
        spec = self._next_arrival = next(self._workload, None)
        if spec is not None:
            self._push(spec.arrival, _ARRIVAL, spec)

    def _on_arrival(self, now: float, spec: RequestSpec) -> None:
        outcome = RequestOutcome(
            index=spec.index,
            id=spec.id or f"r{spec.index}",
            kind=spec.kind,
            arrival=spec.arrival,
            prompt_tokens=spec.prompt_tokens,
            max_tokens=spec.max_tokens,
            priority=_PRIORITY_NAMES[spec.priority],
            stream=spec.stream,
        )
        self.outcomes.append(outcome)
        self._counts["arrivals"] += 1
        # One cost object per request, reused by all its tries.
        self._on_attempt(now, (outcome, spec, RequestCost(spec.prompt_tokens, spec.max_tokens)))
        if spec is self._next_arrival:  # not a follow-up: draw the workload's next
            self._push_next_arrival()

    def _on_attempt(self, now: float, payload: _Request) -> None:
        outcome, spec, cost = payload
        g = self._next_gateway
        self._next_gateway = (g + 1) % self.config.gateways
        flow = self.policies[g]
        rid = f"{outcome.id}#{len(outcome.tries) + 1}"
        client = self.config.client
        says = client.says_timeout
        request = AdmissionRequest(
            rid,
            cost,
            spec.priority,
            tenant=spec.tenant,
            model="sim",
            candidates=self._candidates,
            exact_output=spec.ignore_eos,
            # A read timeout is the SDKs' header, a whole-answer one a proxy's route timeout.
            timeout_s=client.timeout_s if says and client.deadline == "token" else None,
            answer_timeout_s=client.timeout_s if says and client.deadline == "answer" else None,
            stream=spec.stream,
            prompt_ids=spec.prompt_ids,
        )
        decision = flow.submit(request)
        if isinstance(decision, Waiter):
            self._counts["queued"] += 1
            started = now
            decision.notify = lambda d: self._push(
                self.clock.now(), _DECIDED, (payload, rid, g, started, d)
            )
            deadline = min(decision.deadline, now + self.config.client.timeout_s)
            self._push(deadline, _WAIT_END, (payload, g, decision, started))
            return
        self._decided(now, payload, rid, g, now, decision)

    def _on_decided(self, now: float, event: tuple[_Request, str, int, float, Decision]) -> None:
        payload, rid, g, started, decision = event
        self._decided(now, payload, rid, g, started, decision)

    def _on_wait_end(self, now: float, event: tuple[_Request, int, Waiter, float]) -> None:
        """The client's deadline or the queue's bound came while still waiting."""
        payload, g, waiter, started = event
        if not waiter.waiting:
            return
        flow = self.policies[g]
        if now >= started + self.config.client.timeout_s:
            flow.cancel(waiter)
            outcome = payload[0]
            outcome.tries.append(Attempt(started, now, TIMEOUT))
            outcome.timeouts += 1
            self._counts["timeouts"] += 1
            self._retry(now, payload, "timeout")
            return
        # The queue's own bound: `expire` answers with a 429 through `notify`.
        flow.expire(waiter)

    def _decided(
        self, now: float, payload: _Request, rid: str, g: int, started: float, decision: Decision
    ) -> None:
        outcome, spec, _ = payload
        policy = self.policies[g]
        if isinstance(decision, Reject):
            self._counts["rejections"] += 1
            if decision.status == 429:
                self._on_429(now, payload, decision.retry_after_s, started)
            else:
                outcome.tries.append(
                    Attempt(started, now, UNAVAILABLE, retry_after_s=decision.retry_after_s)
                )
                outcome.rejections_5xx += 1
                if decision.status == 400:
                    outcome.status = "bad_request"
                else:
                    self._retry(now, payload, "5xx")
            return
        assert isinstance(decision, Admit)
        ticket = decision.ticket
        node = self._node_index[ticket.node_id]
        engine = self.engines[node]
        try:
            engine.add_request(rid, spec.prompt_tokens, spec.max_tokens, now,
                               ignore_eos=spec.ignore_eos, priority=int(spec.priority),
                               prompt_ids=spec.prompt_ids)  # fmt: skip
        except EngineError:
            policy.release(ticket, Outcome.UPSTREAM_ERROR)
            outcome.tries.append(Attempt(started, now, ERROR, node=ticket.node_id))
            outcome.status = "bad_request"
            return
        self._counts["admissions"] += 1
        outcome.attempts += 1
        outcome.node = ticket.node_id
        record = Attempt(started, math.nan, "", node=ticket.node_id, replica=g)
        record.waited_s = now - started
        outcome.tries.append(record)
        attempt = _Attempt(payload, rid, node, g, ticket, record)
        self._attempts[rid] = attempt
        deadline = started + self.config.client.timeout_s
        if now > started:
            self._push(max(now, deadline), _TIMEOUT, attempt)  # out of the admission order
        else:
            self._deadlines.append((deadline, attempt))
            if not self._sweep_armed:
                self._sweep_armed = True
                self._push(deadline, _TIMEOUT, None)
        self._wake(node, now)

    def _on_429(
        self, now: float, payload: _Request, retry_after: float | None, started: float
    ) -> None:
        outcome = payload[0]
        client = self.config.client
        tries = outcome.tries
        tries.append(Attempt(started, now, SHED, None, 0, retry_after))
        outcome.rejections_429 += 1
        if len(tries) >= client.max_attempts or (
            client.max_429_tries is not None and outcome.rejections_429 >= client.max_429_tries
        ):
            outcome.status = "gave_up_429"
            return
        if client.honor_retry_after and retry_after is not None:
            delay = retry_after
        else:
            delay = client.retry_delay(len(tries), self._rng)
        heapq.heappush(self._heap, (now + delay, next(self._seq), _ATTEMPT, payload))

    def _retry(self, now: float, payload: _Request, kind: str) -> None:
        outcome = payload[0]
        client = self.config.client
        tries = len(outcome.tries)
        if tries >= client.max_attempts or (
            client.max_retries is not None and outcome.retries >= client.max_retries
        ):
            outcome.status = f"gave_up_{kind}"
            return
        outcome.retries += 1
        self._push(now + client.retry_delay(tries, self._rng), _ATTEMPT, payload)

    def _on_timeout(self, now: float, attempt: _Attempt | None) -> None:
        if attempt is not None:
            self._check_timeout(now, attempt)
            return
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            self._check_timeout(now, deadlines.popleft()[1])
        if deadlines:
            self._push(deadlines[0][0], _TIMEOUT, None)
        else:
            self._sweep_armed = False

    def _check_timeout(self, now: float, attempt: _Attempt) -> None:
        if not attempt.active:
            return
        client = self.config.client
        timeout = client.timeout_s
        engine = self.engines[attempt.node]
        if attempt.outcome.stream and client.deadline == "token":
            last = engine.last_token_at(attempt.rid)
            last = attempt.started if last is None else max(last, attempt.started)
            if now - last < timeout * (1 - 1e-9):
                self._push(last + timeout, _TIMEOUT, attempt)
                return
        record = attempt.record
        record.end = now
        record.outcome = TIMEOUT
        record.output_tokens = engine.output_tokens(attempt.rid)
        if engine.config.abort_on_disconnect:
            self._deactivate(attempt, Outcome.CLIENT_CANCEL)
        else:
            # No cascading cancellation: the replica's upstream call runs on to the end.
            self._deactivate(attempt, None)
            attempt.held = True
        engine.disconnect(attempt.rid)
        self._wake(attempt.node, now)
        attempt.outcome.timeouts += 1
        self._counts["timeouts"] += 1
        self._retry(now, attempt.request, "timeout")

    def _deactivate(self, attempt: _Attempt, how: Outcome | None) -> None:
        """The client stops waiting; `how=None` keeps the ticket (released when it ends)."""
        attempt.active = False
        self._streaming[attempt.gateway][attempt.node].pop(attempt.rid, None)
        if how is not None:
            self.policies[attempt.gateway].release(attempt.ticket, how)

    # ------------------------------------------------------------------ engines
    def _wake(self, node: int, now: float) -> None:
        if self._idle[node] and self.engines[node].has_work:
            self._idle[node] = False
            self._push(now, _STEP, node)

    def _on_step(self, now: float, node: int) -> None:
        engine = self.engines[node]
        if engine.in_flight:
            result = engine.finish_step()
            if result.kv_events and self._kv.active:
                self._kv.publish(node, self.node_ids[node], now, result.kv_events)
            self._apply(now, result)
        duration = engine.begin_step(now)
        if duration is None:
            self._idle[node] = True
        else:
            self._push(now + duration, _STEP, node)

    def _on_kv(self, now: float, payload: tuple[Sink, str, KVEventBatch]) -> None:
        sink, node_id, batch = payload  # a batch a replica learns through a view
        sink(node_id, batch)

    def _apply(self, now: float, result: StepResult) -> None:
        attempts = self._attempts
        for rid in result.first_tokens:
            attempt = attempts.get(rid)
            if attempt is not None and attempt.active:
                attempt.record.first_token_at = now
                self.policies[attempt.gateway].on_first_token(attempt.ticket)
                if attempt.outcome.stream:
                    self._streaming[attempt.gateway][attempt.node][rid] = attempt
        for done in result.finished:
            attempt = attempts.pop(done.request_id, None)
            if attempt is None:
                continue
            outcome = attempt.outcome
            outcome.preemptions += done.preemptions
            if not attempt.active:
                outcome.zombie_tokens += done.zombie_tokens
                if attempt.held:
                    self.policies[attempt.gateway].release(attempt.ticket, Outcome.CLIENT_CANCEL)
                continue
            self.policies[attempt.gateway].on_tokens(attempt.ticket, done.output_tokens)
            self._deactivate(attempt, Outcome.DONE)
            record = attempt.record
            record.end = now
            record.outcome = OK
            record.output_tokens = done.output_tokens
            if record.first_token_at is None:
                record.first_token_at = done.first_token_at
            outcome.status = "ok"
            outcome.first_token_at = record.first_token_at
            outcome.completed_at = now
            outcome.output_tokens = done.output_tokens
            self._counts["completions"] += 1
            if self._follow_ups is not None:
                follow = self._follow_ups.next_turn(attempt.spec, now, done.output_tokens)
                if follow is not None:
                    self._push(max(now, follow.arrival), _ARRIVAL, follow)
        for rid in result.aborted:
            attempt = attempts.pop(rid, None)
            if attempt is not None and attempt.held:
                self.policies[attempt.gateway].release(attempt.ticket, Outcome.CLIENT_CANCEL)

    # ------------------------------------------------------------------ gateways
    def _on_scrape(self, now: float, g: int) -> None:
        seen = self._itl_seen[g]
        samples = [scrape(engine, now, seen, i) for i, engine in enumerate(self.engines)]
        self._push(now + self.config.scrape_lag_s, _DELIVER, (g, samples))
        self._push(now + self.config.scrape_interval_s, _SCRAPE, g)

    def _on_deliver(self, now: float, payload: tuple[int, list[NodeSample]]) -> None:
        g, samples = payload
        policy = self.policies[g]
        if now >= self._next_token_update[g]:
            # What the replica has learned from its streams since the last update. Done
            # every `token_update_interval_s`, not per token: O(streams) per update.
            self._next_token_update[g] = now + self.config.token_update_interval_s
            on_tokens = policy.on_tokens
            for i, live in enumerate(self._streaming[g]):
                if live:
                    output_tokens = self.engines[i].output_tokens
                    for rid, attempt in live.items():
                        on_tokens(attempt.ticket, output_tokens(rid))
        for i, sample in enumerate(samples):
            policy.observe(self.node_ids[i], sample)

    # ------------------------------------------------------------------ shared store
    def _on_sync(self, now: float, g: int) -> None:
        """Replica g sends its view (committing it to its claims) to the store."""
        cfg = self.config
        assert cfg.sync_interval_s is not None
        view = self.policies[g].local_view()
        self._push(now + cfg.store_latency_s / 2, _STORE, (g, now, view))
        self._push(now + cfg.sync_interval_s, _SYNC, g)

    def _on_store(self, now: float, payload: tuple[int, float, PeerView]) -> None:
        """The store's atomic exchange: g's view in, every other replica's latest out."""
        g, published_at, view = payload
        self._store[g] = (published_at, view)
        others = [entry for other, entry in self._store.items() if other != g]
        self._push(now + self.config.store_latency_s / 2, _REPLY, (g, others))

    def _on_reply(self, now: float, payload: tuple[int, list[tuple[float, PeerView]]]) -> None:
        g, others = payload
        views = [replace(view, age_s=now - at) for at, view in others]
        self.policies[g].set_peer_views(views, self.config.gateways)

    # ------------------------------------------------------------------ time series
    def _on_series(self, now: float, _: None) -> None:
        queued = sum(flow.waiting for flow in self.policies)
        point, self._last_totals = series_point(
            now, self.engines, self._counts, self._last_totals, queued
        )
        self.series.append(point)
        for key in self._counts:
            self._counts[key] = 0
        self._push(now + self.config.series_interval_s, _SERIES, None)


def run_virtual(
    config: VirtualConfig,
    arrivals: Iterable[RequestSpec] | None = None,
    follow_ups: FollowUps | None = None,
) -> VirtualResult:
    """Run one virtual-time experiment (on `arrivals` if given, else `config.workload`, and
    the requests `follow_ups` adds as answers come)."""
    return VirtualCluster(config, arrivals, follow_ups).run()
