"""A pure model of a paged-KV, continuous-batching inference engine (vLLM v1's scheduler).

No I/O and no clock: the caller passes `now` in. Both the live HTTP simulator and the
virtual-time cluster simulator drive the same object, so a policy tuned in virtual time
meets the same engine behaviour live.

What is modelled, following vLLM v1's `Scheduler.schedule()`:

- A KV cache of `num_blocks` blocks of `block_size` tokens. As in vLLM one block is the
  reserved "null block", so `num_blocks - 1` are usable and KV usage is
  `used / (num_blocks - 1)`. A sequence that has computed `c` tokens holds `ceil(c / bs)`
  blocks; a step that computes `k` more tokens first allocates `ceil((c + k) / bs)`.
- Each step schedules the running sequences first (a decoding sequence takes one token of
  the `max_num_batched_tokens` budget, a prefilling one a chunk of what is left), then, only
  if nobody was preempted this step, admits waiting requests in FCFS order (or by
  priority) while `max_num_seqs`, the token budget and the free blocks allow. The head of
  the queue blocks the queue: a request is admitted only when its first chunk's blocks fit.
- When a running sequence needs a block and none is free, the newest running sequence is
  preempted in recompute mode: all its blocks are freed, it goes back to the head of the
  waiting queue, and later it prefills its prompt *and* the tokens it had generated again.
  Like vLLM, `preemptions_total` counts a preemption only when the request produces its
  next token (the engine-side count is kept too, as `preemptions_evicted`).
- A step has two halves: `begin_step(now)` removes aborted requests, schedules and
  allocates blocks, and returns its duration; `finish_step()` applies the step's outcome at
  `now + duration` (tokens, first tokens, finished requests, freed blocks). `step(now)` does
  both. An abort or disconnect arriving while a step is in flight takes effect at the next
  `begin_step`; a token produced for a client that had already gone is a *zombie* token.
- Step latency is a roofline: `fixed + per_prefill_token * prefill_tokens + per_seq *
  sequences + per_context_token * context tokens attended`.

With `enable_prefix_caching` the block pool caches full blocks across requests as vLLM
v1 does (`kvgate.sim.model.prefix`): a request given its prompt's token ids starts with
its cached leading blocks computed (prefill time only for the rest), a block shared by
several requests counts once in `kv_usage`, and the engine keeps vLLM's
`prefix_cache_queries` / `prefix_cache_hits` counters; with `record_kv_events` each step's
result carries the KV events vLLM would publish for it (`kvgate.core.prefix.events`).

Decoding sequences are kept in an aggregate form (a global decode-step counter, a count of
sequences per block phase, a heap of finish steps: `kvgate.sim.model.decoding`), so a step costs
O(prefilling sequences + events), not O(running sequences), and FCFS preemption costs
O(victims) (`kvgate.sim.model.scheduler`, which also holds the block pool). A request inside the
engine and the waiting queue are in `kvgate.sim.model.sequences`, the configuration in
`kvgate.sim.model.config`, the histograms in `kvgate.sim.model.histogram`.
`tests/sim/test_engine_reference.py` checks it step for step against a naive transcription
of vLLM's walk. Documented simplifications: within a step, decoding sequences take their
token of the budget before any prefill chunk (vLLM walks the running list in admission
order; the two differ only when the budget runs out mid-list); with priority scheduling,
when the sequence being scheduled is itself the lowest-priority victim, vLLM stops the
walk for that step while the simulator goes on scheduling the sequences after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from kvgate.core.prefix.events import KVEvent
from kvgate.sim.model.config import EngineConfig, StepLatency
from kvgate.sim.model.histogram import (
    E2E_BUCKETS,
    ITERATION_TOKEN_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)
from kvgate.sim.model.scheduler import Scheduler
from kvgate.sim.model.sequences import DECODE, Seq, eos_length

#: What driving an engine takes: the configuration that defines it, and what it returns.
__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineSnapshot",
    "FinishReason",
    "FinishedRequest",
    "StepLatency",
    "StepResult",
]

FinishReason = Literal["length", "stop"]


class EngineError(ValueError):
    """A request the engine refuses outright (too long, bad parameters, duplicate id)."""


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token_at: float | None
    finished_at: float
    preemptions: int
    zombie_tokens: int
    client_gone: bool


@dataclass(slots=True)
class StepResult:
    """What one step did. `emitted` is filled only when the engine records emissions,
    `kv_events` only when it records KV events (vLLM publishes them as one batch)."""

    start: float
    duration: float
    emitted: list[str] = field(default_factory=list)
    first_tokens: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges and counters at one instant; histograms are the engine's live objects."""

    num_blocks: int
    block_size: int
    kv_usage: float
    used_blocks: int
    running: int
    waiting: int
    preemptions_total: int
    preemptions_evicted: int
    prompt_tokens_total: int
    generation_tokens_total: int
    recomputed_tokens_total: int
    zombie_tokens_total: int
    success_total: dict[str, int]
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    iteration_tokens: Histogram


@dataclass(slots=True)
class _InFlight:
    start: float
    duration: float
    prefills: list[tuple[Seq, int]]
    decoding: int
    preempted: list[str]
    aborted: list[str]


class Engine:
    """One simulated engine. Not thread-safe; drive it from one task or loop."""

    def __init__(
        self,
        config: EngineConfig,
        seed: int | None = 0,
        record_emissions: bool = False,
        record_kv_events: bool = False,
    ) -> None:
        self.config = config
        self.record_emissions = record_emissions
        self._rng = random.Random(seed)
        self._sched = Scheduler(config, record_kv_events)
        self._cache = self._sched.cache
        self._decode = self._sched.decode
        self._seqs: dict[str, Seq] = {}  # every request not yet finished or aborted
        self._pending_aborts: list[str] = []
        self._in_flight: _InFlight | None = None
        self._last_step_end: float | None = None
        self._order = 0
        # Counters and histograms, vLLM-named where vLLM has them.
        self.preemptions_total = 0
        self.preemptions_evicted = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.recomputed_tokens_total = 0
        self.zombie_tokens_total = 0
        self.success_total: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.steps_total = 0
        self.busy_seconds_total = 0.0  # sum of modelled step durations

    # ----------------------------------------------------------------- requests in
    def add_request(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int | None,
        now: float,
        *,
        ignore_eos: bool = False,
        priority: int = 0,
        prompt_ids: tuple[int, ...] | None = None,
    ) -> None:
        """Queue a request; it is scheduled at the next `begin_step`. Raises EngineError.

        `prompt_ids` (as many as `prompt_tokens`) let a prefix-caching engine share the
        prompt's blocks with other requests; without them the prompt shares nothing."""
        limit = self.config.max_model_len
        if request_id in self._seqs:
            raise EngineError(f"request id {request_id!r} is already in use")
        if prompt_ids is not None and len(prompt_ids) != prompt_tokens:
            raise EngineError("prompt_ids must hold exactly prompt_tokens ids")
        if prompt_tokens < 1:
            raise EngineError("the prompt must contain at least one token")
        if prompt_tokens >= limit:
            raise EngineError(
                f"this model's maximum context length is {limit} tokens, but the prompt "
                f"has {prompt_tokens} tokens"
            )
        if max_tokens is None:
            max_tokens = limit - prompt_tokens
        if max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if prompt_tokens + max_tokens > limit:
            raise EngineError(
                f"this model's maximum context length is {limit} tokens; the prompt "
                f"({prompt_tokens}) plus max_tokens ({max_tokens}) exceeds it"
            )
        if ignore_eos:
            target = max_tokens
        else:
            target = min(max_tokens, eos_length(self._rng, self.config.eos_mean_tokens))
        self._order += 1
        seq = Seq(
            request_id=request_id,
            prompt=prompt_tokens,
            max_tokens=max_tokens,
            target=target,
            ignore_eos=ignore_eos,
            priority=priority,
            arrival=now,
            order=self._order,
        )
        if self._cache is not None:
            seq.ids = prompt_ids
        self._seqs[request_id] = seq
        self._sched.waiting.push_back(seq)

    def abort(self, request_id: str) -> bool:
        """Remove a request at the next step (vLLM's abort). False if it is unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._mark_zombie(seq)
        self._pending_aborts.append(request_id)
        return True

    def disconnect(self, request_id: str) -> bool:
        """The client went away: abort, or leave a zombie if `abort_on_disconnect` is off."""
        if self.config.abort_on_disconnect:
            return self.abort(request_id)
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._mark_zombie(seq)
        return True

    def _mark_zombie(self, seq: Seq) -> None:
        if seq.gone:
            return
        seq.gone = True
        if seq.state == DECODE:
            self._decode.client_gone(seq)
        else:
            seq.gone_at = seq.generated

    # ----------------------------------------------------------------- queries
    @property
    def has_work(self) -> bool:
        sched = self._sched
        return bool(sched.running) or sched.waiting.size > 0 or bool(self._pending_aborts)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self._sched.running)

    @property
    def num_waiting(self) -> int:
        return self._sched.waiting.size

    @property
    def used_blocks(self) -> int:
        return self._sched.used

    @property
    def kv_usage(self) -> float:
        return self._sched.used / self._sched.usable

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def output_tokens(self, request_id: str) -> int:
        """Tokens generated so far for a live request (0 if unknown)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return 0
        return seq.gbase + self._decode.g if seq.state == DECODE else seq.generated

    def last_token_at(self, request_id: str) -> float | None:
        """When a live request last produced a token (None: unknown or none yet)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.first_token_at is None:
            return None
        return self._last_step_end if seq.state == DECODE else seq.last_token_at

    @property
    def prefix_cache_queries_total(self) -> int:
        """Prompt tokens of the requests admitted so far (vLLM's prefix cache queries)."""
        return 0 if self._cache is None else self._cache.queries

    @property
    def prefix_cache_hits_total(self) -> int:
        """Of those, the tokens found cached (vLLM's prefix cache hits)."""
        return 0 if self._cache is None else self._cache.hits

    def reset_prefix_cache(self) -> bool:
        """vLLM's `/reset_prefix_cache`: forget every cached block (`AllBlocksCleared`);
        False while a request holds blocks, or without prefix caching."""
        return self._sched.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events recorded since the last step's result took them (a reset's)."""
        return [] if self._cache is None else self._cache.take_events()

    def blocks_in_use(self) -> int:
        """Blocks held, recounted from every running request (a shared one once)."""
        return self._sched.blocks_in_use()

    def blocks_held(self) -> dict[str, int]:
        """Blocks per running request, recomputed from scratch (for tests and audits)."""
        sched = self._sched
        return {rid: sched.blocks_of(seq) for rid, seq in sched.running.items()}

    def metrics_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            num_blocks=self.config.num_blocks,
            block_size=self.config.block_size,
            kv_usage=self.kv_usage,
            used_blocks=self._sched.used,
            running=self.num_running,
            waiting=self.num_waiting,
            preemptions_total=self.preemptions_total,
            preemptions_evicted=self.preemptions_evicted,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            recomputed_tokens_total=self.recomputed_tokens_total,
            zombie_tokens_total=self.zombie_tokens_total,
            success_total=dict(self.success_total),
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
            ttft=self.ttft,
            itl=self.itl,
            e2e=self.e2e,
            iteration_tokens=self.iteration_tokens,
        )

    # ----------------------------------------------------------------- stepping
    def step(self, now: float) -> StepResult | None:
        """Run one whole step starting at `now`; None when there is nothing to do."""
        if self.begin_step(now) is None:
            return None
        return self.finish_step()

    def begin_step(self, now: float) -> float | None:
        """Abort, schedule and allocate; return the step's duration, None if idle."""
        if self._in_flight is not None:
            raise RuntimeError("begin_step called twice without finish_step")
        aborted = self._apply_aborts()
        sched = self._sched
        if not sched.running and sched.waiting.size == 0:
            if not aborted:
                return None
            # Only aborts to report: a zero-length bookkeeping step.
            self._in_flight = _InFlight(now, 0.0, [], 0, [], aborted)
            return 0.0
        prefills, preempted = sched.schedule()
        self.preemptions_evicted += len(preempted)
        decoding = self._decode.count
        prefill_tokens = sum(chunk for _, chunk in prefills)
        context = self._decode.context_tokens()
        context += sum(seq.computed for seq, _ in prefills)
        seqs = decoding + len(prefills)
        duration = self.config.latency.duration(prefill_tokens, seqs, context)
        self.iteration_tokens.observe(prefill_tokens + decoding)
        self._in_flight = _InFlight(now, duration, prefills, decoding, preempted, aborted)
        return duration

    def finish_step(self) -> StepResult:
        """Apply the in-flight step's outcome at its end time."""
        flight = self._in_flight
        if flight is None:
            raise RuntimeError("finish_step called without begin_step")
        self._in_flight = None
        end = flight.start + flight.duration
        result = StepResult(flight.start, flight.duration)
        result.preempted = flight.preempted
        result.aborted = flight.aborted
        if flight.duration == 0.0:
            if self._cache is not None:
                result.kv_events = self._cache.take_events()
            return result
        self.steps_total += 1
        self.busy_seconds_total += flight.duration
        if self.record_emissions and flight.decoding:
            running = self._sched.running.values()
            result.emitted = [s.request_id for s in running if s.state == DECODE]
        if flight.decoding:
            self._decode.g += 1
            self.generation_tokens_total += flight.decoding
            self.zombie_tokens_total += self._decode.zombies
            if self._last_step_end is not None:
                self.itl.observe(end - self._last_step_end, flight.decoding)
        for seq, chunk in flight.prefills:
            self._apply_prefill(seq, chunk, end, result)
        self._pop_finished(end, result)
        self._last_step_end = end
        if self._cache is not None:
            result.kv_events = self._cache.take_events()
        return result

    def _apply_prefill(self, seq: Seq, chunk: int, end: float, result: StepResult) -> None:
        start = seq.computed
        seq.computed += chunk
        if start < seq.max_computed:
            self.recomputed_tokens_total += min(seq.computed, seq.max_computed) - start
        if seq.computed < seq.prompt + seq.generated:
            return
        # Prefill (or re-prefill) done: this step samples the next token.
        seq.generated += 1
        self.generation_tokens_total += 1
        if seq.gone:
            self.zombie_tokens_total += 1
        if seq.first_token_at is None:
            seq.first_token_at = end
            self.ttft.observe(end - seq.arrival)
            self.prompt_tokens_total += seq.prompt
            result.first_tokens.append(seq.request_id)
        else:
            self.itl.observe(end - seq.last_token_at)
        if seq.uncounted_preemptions:
            self.preemptions_total += seq.uncounted_preemptions
            seq.uncounted_preemptions = 0
        seq.last_token_at = end
        if self.record_emissions:
            result.emitted.append(seq.request_id)
        self._sched.start_decoding(seq)

    def _pop_finished(self, end: float, result: StepResult) -> None:
        for seq in self._decode.finished():
            seq.last_token_at = end
            self._sched.release(seq)
            del self._seqs[seq.request_id]
            reason: FinishReason = "length" if seq.generated >= seq.max_tokens else "stop"
            self.success_total[reason] += 1
            self.e2e.observe(end - seq.arrival)
            result.finished.append(
                FinishedRequest(
                    request_id=seq.request_id,
                    reason=reason,
                    prompt_tokens=seq.prompt,
                    output_tokens=seq.generated,
                    arrival=seq.arrival,
                    first_token_at=seq.first_token_at,
                    finished_at=end,
                    preemptions=seq.preemptions,
                    zombie_tokens=seq.generated - seq.gone_at if seq.gone else 0,
                    client_gone=seq.gone,
                )
            )

    # ----------------------------------------------------------------- removal
    def _apply_aborts(self) -> list[str]:
        done: list[str] = []
        for rid in self._pending_aborts:
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            self._sched.remove(seq)
            del self._seqs[rid]
            done.append(rid)
        self._pending_aborts.clear()
        return done
