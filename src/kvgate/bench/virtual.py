"""Virtual-time runs: N simulated engines behind one admission policy, with real-ish clients.

A discrete-event loop (no sleeping) drives `kvgate.sim.engine.Engine` objects step by step
and the very `AdmissionPolicy` object the gateway uses, on a `ManualClock`. Engines are
scraped every `scrape_s` (50 ms, as the gateway does) and each sample reaches the policy
`scrape_lag_s` later. Clients follow `ClientConfig`: a timeout disconnects (the engine
aborts the request at its next step if cancellation is propagated; otherwise the request
runs on as a zombie and its ticket is held until the engine finishes it, as a gateway
without cascading cancellation would); timeouts are retried; a 429 waits its Retry-After.

`direct` is the `none` policy: no admission, requests spread least-connections, client
disconnects reach the engine, exactly as if clients talked to the engines through a plain
load balancer.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgate.bench.metrics import (
    ERROR,
    OK,
    SHED,
    TIMEOUT,
    UNAVAILABLE,
    Attempt,
    EngineTotals,
    RunResult,
    UserRequest,
)
from kvgate.bench.suite import RunSpec
from kvgate.bench.workload import Arrival, burst_times, generate
from kvgate.core.admission import Admit, Outcome, Ticket
from kvgate.core.clock import ManualClock
from kvgate.core.policies import build_policy
from kvgate.core.request import Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample
from kvgate.sim.engine import Engine, EngineError
from kvgate.sim.presets import get_preset

# Event kinds, ordered so that at equal times engine steps finish before new work arrives.
_STEP_END, _OBSERVE, _TIMEOUT, _ATTEMPT, _SCRAPE, _TICK = range(6)


@dataclasses.dataclass(slots=True)
class _Live:
    """An attempt in flight on an engine."""

    user: UserRequest
    attempt: Attempt
    ticket: Ticket
    engine: int
    tries: int


class VirtualCluster:
    """One run's state: engines, policy, clients, series. Use `run_virtual(spec)`."""

    def __init__(
        self,
        spec: RunSpec,
        scrape_s: float = 0.05,
        scrape_lag_s: float = 0.01,
        series_step_s: float = 0.5,
        token_update_s: float = 0.25,
        arrivals: Sequence[Arrival] | None = None,
    ) -> None:
        self.spec = spec
        self.arrivals = arrivals
        self.clock = ManualClock()
        cfg = dataclasses.replace(get_preset(spec.preset), abort_on_disconnect=spec.cancel)
        self.engines = [Engine(cfg, seed=spec.seed * 1000 + i) for i in range(spec.nodes)]
        self.node_ids = [f"n{i}" for i in range(spec.nodes)]
        self.node_index = {nid: i for i, nid in enumerate(self.node_ids)}
        self.capacity = cfg.kv_capacity_tokens
        settings = AdmissionSettings(policy=spec.policy, seed=spec.seed, **spec.policy_overrides)
        self.policy = build_policy(settings, self.clock, rng_seed=spec.seed)
        for nid in self.node_ids:
            self.policy.add_node(nid)
        self.scrape_s, self.lag_s = scrape_s, scrape_lag_s
        self.series_step_s = series_step_s
        self.token_every = max(1, round(token_update_s / scrape_s))
        self.horizon = spec.duration_s + spec.client.timeout_s + 1.0
        self.rng = np.random.default_rng([spec.seed, 11])
        self._events: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self.live: dict[str, _Live] = {}
        self.zombie_tickets: dict[str, Ticket] = {}
        self.by_engine: list[dict[str, _Live]] = [{} for _ in self.engines]
        self.users: list[UserRequest] = []
        self._itl_prev = [(0.0, 0) for _ in self.engines]
        self._scrapes = 0
        self._admitted = 0
        self._rejected = 0
        self._pre_prev = 0
        self.series: dict[str, list[float]] = {
            k: []
            for k in (
                "t",
                "kv_usage_max",
                "kv_usage_mean",
                "running",
                "waiting",
                "admitted",
                "rejected",
                "preemptions",
                "shed_prob",
            )
        }

    # --- the loop ----------------------------------------------------------------------------

    def _push(self, when: float, kind: int, data: Any = None) -> None:
        self._n += 1
        heapq.heappush(self._events, (when, kind, self._n, data))

    def run(self) -> RunResult:
        spec = self.spec
        arrivals = self.arrivals
        if arrivals is None:
            arrivals = generate(spec.shape, spec.nodes, spec.duration_s, spec.load, spec.seed)
        for a in arrivals:
            user = UserRequest(
                a.id, a.kind, a.t, a.prompt_tokens, a.max_tokens, spec.client.timeout_s
            )
            self.users.append(user)
            self._push(a.t, _ATTEMPT, (user, 1))
        self._push(0.0, _SCRAPE)
        self._push(0.0, _TICK)
        while self._events:
            when, kind, _, data = heapq.heappop(self._events)
            if when > self.horizon:
                break
            self.clock.set(when)
            if kind == _STEP_END:
                self._step_end(data)
            elif kind == _ATTEMPT:
                self._attempt(*data)
            elif kind == _TIMEOUT:
                self._timeout(data)
            elif kind == _SCRAPE:
                self._scrape()
            elif kind == _OBSERVE:
                for nid, sample in data:
                    self.policy.observe(nid, sample)
            else:
                self._tick()
        return self._result()

    # --- clients -----------------------------------------------------------------------------

    def _attempt(self, user: UserRequest, tries: int) -> None:
        now = self.clock.now()
        rid = f"{user.id}#{tries}"
        cost = RequestCost(user.prompt_tokens, user.max_tokens)
        decision = self.policy.admit(rid, cost, Priority.STANDARD, self.node_ids)
        if not isinstance(decision, Admit):
            self._rejected += 1
            outcome = SHED if decision.status == 429 else UNAVAILABLE
            user.attempts.append(Attempt(now, now, outcome, retry_after_s=decision.retry_after_s))
            delay = decision.retry_after_s if self.spec.client.honor_retry_after else None
            self._retry(user, tries, delay)
            return
        self._admitted += 1
        ticket = decision.ticket
        idx = self.node_index[ticket.node_id]
        engine = self.engines[idx]
        try:
            engine.add_request(rid, user.prompt_tokens, user.max_tokens, now, ignore_eos=True)
        except EngineError:
            self.policy.release(ticket, Outcome.UPSTREAM_ERROR)
            user.attempts.append(Attempt(now, now, ERROR, node=ticket.node_id))
            return
        attempt = Attempt(now, math.nan, "", node=ticket.node_id)
        user.attempts.append(attempt)
        live = _Live(user, attempt, ticket, idx, tries)
        self.live[rid] = live
        self.by_engine[idx][rid] = live
        self._push(now + user.timeout_s, _TIMEOUT, rid)
        self._kick(idx)

    def _retry(self, user: UserRequest, tries: int, delay: float | None) -> None:
        """Schedule try `tries + 1` unless the user is out of tries."""
        client = self.spec.client
        if tries >= client.max_attempts:
            return
        if delay is None:
            delay = client.retry_delay(tries, self.rng)
        self._push(self.clock.now() + delay, _ATTEMPT, (user, tries + 1))

    def _timeout(self, rid: str) -> None:
        live = self.live.pop(rid, None)
        if live is None:
            return  # it finished in time
        now = self.clock.now()
        engine = self.engines[live.engine]
        del self.by_engine[live.engine][rid]
        live.attempt.end = now
        live.attempt.outcome = TIMEOUT
        live.attempt.output_tokens = engine.output_tokens(rid)
        engine.disconnect(rid)
        if self.spec.cancel:
            self.policy.release(live.ticket, Outcome.CLIENT_CANCEL)
        else:
            # No cascading cancellation: the gateway's upstream call runs on to the end.
            self.zombie_tickets[rid] = live.ticket
        self._kick(live.engine)
        self._retry(live.user, live.tries, None)

    # --- engines -----------------------------------------------------------------------------

    def _kick(self, idx: int) -> None:
        """Start a step on an idle engine that has work."""
        engine = self.engines[idx]
        if engine.in_flight or not engine.has_work:
            return
        now = self.clock.now()
        duration = engine.begin_step(now)
        if duration is not None:
            self._push(now + duration, _STEP_END, idx)

    def _step_end(self, idx: int) -> None:
        engine = self.engines[idx]
        result = engine.finish_step()
        now = self.clock.now()
        on_engine = self.by_engine[idx]
        for rid in result.first_tokens:
            live = on_engine.get(rid)
            if live is not None and live.attempt.first_token_at is None:
                live.attempt.first_token_at = now
                self.policy.on_first_token(live.ticket)
        for fin in result.finished:
            live = on_engine.pop(fin.request_id, None)
            if live is not None:
                del self.live[fin.request_id]
                live.attempt.end = now
                live.attempt.outcome = OK
                live.attempt.output_tokens = fin.output_tokens
                if live.attempt.first_token_at is None:
                    live.attempt.first_token_at = fin.first_token_at
                self.policy.release(live.ticket, Outcome.DONE)
            else:
                ticket = self.zombie_tickets.pop(fin.request_id, None)
                if ticket is not None:
                    self.policy.release(ticket, Outcome.CLIENT_CANCEL)
        self._kick(idx)

    # --- signals and series ------------------------------------------------------------------

    def _scrape(self) -> None:
        now = self.clock.now()
        self._scrapes += 1
        update_tokens = self._scrapes % self.token_every == 0
        samples = []
        for i, (nid, engine) in enumerate(zip(self.node_ids, self.engines, strict=True)):
            if update_tokens:
                for rid, live in self.by_engine[i].items():
                    if live.attempt.first_token_at is not None:
                        self.policy.on_tokens(live.ticket, engine.output_tokens(rid))
            itl_sum, itl_count = engine.itl.sum, engine.itl.count
            prev_sum, prev_count = self._itl_prev[i]
            self._itl_prev[i] = (itl_sum, itl_count)
            itl = (
                (itl_sum - prev_sum) / (itl_count - prev_count) if itl_count > prev_count else None
            )
            samples.append(
                (
                    nid,
                    NodeSample(
                        kv_usage=engine.kv_usage,
                        kv_capacity_tokens=self.capacity,
                        running=engine.num_running,
                        waiting=engine.num_waiting,
                        iteration_latency_s=itl,
                        sampled_at=now,
                        preemptions_total=float(engine.preemptions_total),
                    ),
                )
            )
        self._push(now + self.lag_s, _OBSERVE, samples)
        if now + self.scrape_s <= self.horizon:
            self._push(now + self.scrape_s, _SCRAPE)

    def _tick(self) -> None:
        now = self.clock.now()
        s = self.series
        kv = [e.kv_usage for e in self.engines]
        pre = sum(e.preemptions_evicted for e in self.engines)
        s["t"].append(now)
        s["kv_usage_max"].append(max(kv))
        s["kv_usage_mean"].append(sum(kv) / len(kv))
        s["running"].append(float(sum(e.num_running for e in self.engines)))
        s["waiting"].append(float(sum(e.num_waiting for e in self.engines)))
        s["admitted"].append(float(self._admitted))
        s["rejected"].append(float(self._rejected))
        s["preemptions"].append(float(pre - self._pre_prev))
        s["shed_prob"].append(_shed_probability(self.policy.snapshot()))
        self._admitted = self._rejected = 0
        self._pre_prev = pre
        if now + self.series_step_s <= self.horizon:
            self._push(now + self.series_step_s, _TICK)

    def _result(self) -> RunResult:
        spec = self.spec
        totals = EngineTotals(
            preemptions=sum(e.preemptions_evicted for e in self.engines),
            recomputed_tokens=sum(e.recomputed_tokens_total for e in self.engines),
            zombie_tokens=sum(e.zombie_tokens_total for e in self.engines),
            generated_tokens=sum(e.generation_tokens_total for e in self.engines),
        )
        # Attempts still open at the horizon ended with the run: score them as timeouts.
        for live in self.live.values():
            live.attempt.end = self.horizon
            live.attempt.outcome = TIMEOUT
        return RunResult(
            policy=spec.label,
            load=spec.load,
            seed=spec.seed,
            preset=spec.preset,
            nodes=spec.nodes,
            duration_s=spec.duration_s,
            warmup_s=spec.warmup_s,
            slo=spec.slo,
            requests=self.users,
            totals=totals,
            series=self.series,
            bursts=burst_times(spec.shape.scaled(spec.load), spec.duration_s),
            extra={"policy_overrides": dict(spec.policy_overrides)},
        )


def _shed_probability(snapshot: dict[str, Any]) -> float:
    """The controller's shed probability for standard traffic (0 for policies without one)."""
    ctrl = snapshot.get("controller") or {}
    prob = ctrl.get("shed_probability")
    if isinstance(prob, dict):
        return float(prob.get("standard") or 0.0)
    if isinstance(prob, (int, float)):
        return float(prob)
    return 0.0


def run_virtual(spec: RunSpec, arrivals: Sequence[Arrival] | None = None) -> RunResult:
    """Run one spec in virtual time (its seeded workload, or `arrivals`); return the records."""
    return VirtualCluster(spec, arrivals=arrivals).run()
