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

Decoding sequences are kept in an aggregate form (a global decode-step counter, a count of
sequences per block phase, a heap of finish steps), so a step costs O(prefilling sequences
+ events), not O(running sequences), and FCFS preemption costs O(victims).
`tests/sim/test_engine_reference.py` checks it step for step against a naive transcription
of vLLM's walk. Documented simplifications: within a step, decoding sequences take their
token of the budget before any prefill chunk (vLLM walks the running list in admission
order; the two differ only when the budget runs out mid-list); with priority scheduling,
when the sequence being scheduled is itself the lowest-priority victim, vLLM stops the
walk for that step while the simulator goes on scheduling the sequences after it.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

# Histogram bucket bounds copied from a real vLLM metrics page (see scripts/real-vllm).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip

FinishReason = Literal["length", "stop"]

_WAITING, _PREFILL, _DECODE, _DONE = 0, 1, 2, 3


class EngineError(ValueError):
    """A request the engine refuses outright (too long, bad parameters, duplicate id)."""


@dataclass(frozen=True, slots=True)
class StepLatency:
    """Roofline step-time model; every term is in seconds."""

    fixed_s: float
    per_prefill_token_s: float
    per_seq_s: float
    per_context_token_s: float

    def duration(self, prefill_tokens: int, seqs: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_seq_s * seqs
            + self.per_context_token_s * context_tokens
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that defines one engine. `num_blocks` counts vLLM's null block too."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    latency: StepLatency
    enable_chunked_prefill: bool = True
    scheduling: Literal["fcfs", "priority"] = "fcfs"
    abort_on_disconnect: bool = True
    eos_mean_tokens: float = 256.0

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1:
            raise ValueError("num_blocks must be >= 2 and block_size >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need 1 <= max_num_seqs <= max_num_batched_tokens")
        if self.latency.fixed_s <= 0:
            raise ValueError("a step must take some time: latency.fixed_s must be > 0")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.eos_mean_tokens < 1:
            raise ValueError("eos_mean_tokens must be >= 1")
        if self.max_model_len > self.usable_blocks * self.block_size:
            # vLLM refuses to start in this case too: one full-length sequence must fit.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the KV cache's usable capacity "
                f"({self.usable_blocks * self.block_size} tokens): lower max_model_len or "
                "add blocks"
            )

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """What a gateway computes from `cache_config_info`: num_gpu_blocks x block_size."""
        return self.num_blocks * self.block_size


class Histogram:
    """A cumulative Prometheus-style histogram kept as plain lists (cheap to observe)."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[int]:
        """Counts per `le` bound, the last one being +Inf."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


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
    """What one step did. `emitted` is filled only when the engine records emissions."""

    start: float
    duration: float
    emitted: list[str] = field(default_factory=list)
    first_tokens: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

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
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    iteration_tokens: Histogram


class _Seq:
    """One request inside the engine. Decoding ones keep their counts relative to `_g`."""

    __slots__ = (
        "arrival",
        "computed",
        "first_token_at",
        "gbase",
        "generated",
        "gone",
        "gone_at",
        "ignore_eos",
        "last_token_at",
        "max_computed",
        "max_tokens",
        "order",
        "phase",
        "preemptions",
        "priority",
        "prompt",
        "request_id",
        "state",
        "target",
        "uncounted_preemptions",
    )

    def __init__(
        self,
        request_id: str,
        prompt: int,
        max_tokens: int,
        target: int,
        ignore_eos: bool,
        priority: int,
        arrival: float,
        order: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.target = target
        self.ignore_eos = ignore_eos
        self.priority = priority
        self.arrival = arrival
        self.order = order
        self.state = _WAITING
        self.generated = 0
        self.computed = 0
        self.max_computed = 0
        self.gbase = 0
        self.phase = 0
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.gone = False
        self.preemptions = 0
        self.uncounted_preemptions = 0
        self.gone_at = 0  # tokens generated when the client left


class _WaitingQueue:
    """vLLM's waiting queue: a deque (FCFS) or a heap on (priority, arrival) (priority).

    Removal is lazy: an aborted sequence is marked done and skipped when it reaches the
    front, so `abort` stays O(1).
    """

    def __init__(self, by_priority: bool) -> None:
        self._by_priority = by_priority
        self._fifo: deque[_Seq] = deque()
        self._heap: list[tuple[int, float, int, _Seq]] = []
        self.size = 0

    def push_back(self, seq: _Seq) -> None:
        self.size += 1
        if self._by_priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.order, seq))
        else:
            self._fifo.append(seq)

    def push_front(self, seq: _Seq) -> None:
        self.size += 1
        if self._by_priority:
            heapq.heappush(self._heap, (seq.priority, seq.arrival, seq.order, seq))
        else:
            self._fifo.appendleft(seq)

    def peek(self) -> _Seq | None:
        if self._by_priority:
            while self._heap and self._heap[0][3].state != _WAITING:
                heapq.heappop(self._heap)
            return self._heap[0][3] if self._heap else None
        while self._fifo and self._fifo[0].state != _WAITING:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> _Seq:
        seq = heapq.heappop(self._heap)[3] if self._by_priority else self._fifo.popleft()
        self.size -= 1
        return seq

    def discard(self, seq: _Seq) -> None:
        """Called after `seq.state` left _WAITING; the entry itself is dropped lazily."""
        self.size -= 1


@dataclass(slots=True)
class _InFlight:
    start: float
    duration: float
    prefills: list[tuple[_Seq, int]]
    decoding: int
    preempted: list[str]
    aborted: list[str]


class Engine:
    """One simulated engine. Not thread-safe; drive it from one task or loop."""

    def __init__(
        self, config: EngineConfig, seed: int | None = 0, record_emissions: bool = False
    ) -> None:
        self.config = config
        self.record_emissions = record_emissions
        self._rng = random.Random(seed)
        self._bs = config.block_size
        self._usable = config.usable_blocks
        self._used = 0
        self._seqs: dict[str, _Seq] = {}  # every request not yet finished or aborted
        self._running: dict[str, _Seq] = {}  # admission order = vLLM's running list
        self._waiting = _WaitingQueue(config.scheduling == "priority")
        self._prefilling: dict[str, _Seq] = {}  # running, prompt not yet fully computed
        # Aggregate state of decoding sequences (see module docstring).
        self._g = 0  # decode steps taken so far; a decoding seq has generated gbase + _g
        self._n_decode = 0
        self._n_decode_zombie = 0
        self._phase_count = [0] * self._bs
        self._decode_ctx_base = 0  # sum over decoding seqs of (prompt + gbase - 1)
        self._finish_heap: list[tuple[int, int, _Seq]] = []
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
    ) -> None:
        """Queue a request; it is scheduled at the next `begin_step`. Raises EngineError."""
        limit = self.config.max_model_len
        if request_id in self._seqs:
            raise EngineError(f"request id {request_id!r} is already in use")
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
        target = max_tokens if ignore_eos else min(max_tokens, self._sample_eos_length())
        self._order += 1
        seq = _Seq(
            request_id,
            prompt_tokens,
            max_tokens,
            target,
            ignore_eos,
            priority,
            now,
            self._order,
        )
        self._seqs[request_id] = seq
        self._waiting.push_back(seq)

    def _sample_eos_length(self) -> int:
        """Output length when EOS is sampled: geometric with the configured mean."""
        p = 1.0 / self.config.eos_mean_tokens
        if p >= 1.0:
            return 1
        u = 1.0 - self._rng.random()  # in (0, 1]
        return 1 + int(math.log(u) / math.log1p(-p))

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

    def _mark_zombie(self, seq: _Seq) -> None:
        if seq.gone:
            return
        seq.gone = True
        if seq.state == _DECODE:
            seq.gone_at = seq.gbase + self._g
            self._n_decode_zombie += 1
        else:
            seq.gone_at = seq.generated

    # ----------------------------------------------------------------- queries
    @property
    def has_work(self) -> bool:
        return bool(self._running) or self._waiting.size > 0 or bool(self._pending_aborts)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._waiting.size

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def kv_usage(self) -> float:
        return self._used / self._usable

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def output_tokens(self, request_id: str) -> int:
        """Tokens generated so far for a live request (0 if unknown)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return 0
        return seq.gbase + self._g if seq.state == _DECODE else seq.generated

    def last_token_at(self, request_id: str) -> float | None:
        """When a live request last produced a token (None: unknown or none yet)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.first_token_at is None:
            return None
        return self._last_step_end if seq.state == _DECODE else seq.last_token_at

    def blocks_held(self) -> dict[str, int]:
        """Blocks per running request, recomputed from scratch (for tests and audits)."""
        return {rid: self._blocks_of(seq) for rid, seq in self._running.items()}

    def metrics_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            num_blocks=self.config.num_blocks,
            block_size=self._bs,
            kv_usage=self.kv_usage,
            used_blocks=self._used,
            running=len(self._running),
            waiting=self._waiting.size,
            preemptions_total=self.preemptions_total,
            preemptions_evicted=self.preemptions_evicted,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            recomputed_tokens_total=self.recomputed_tokens_total,
            zombie_tokens_total=self.zombie_tokens_total,
            success_total=dict(self.success_total),
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
        if not self._running and self._waiting.size == 0:
            if not aborted:
                return None
            # Only aborts to report: a zero-length bookkeeping step.
            self._in_flight = _InFlight(now, 0.0, [], 0, [], aborted)
            return 0.0
        budget = self.config.max_num_batched_tokens - self._n_decode
        prefills: list[tuple[_Seq, int]] = []
        preempted: list[str] = []
        need = self._phase_count[-self._g % self._bs] if self._n_decode else 0
        for seq in self._prefilling.values():
            chunk = min(seq.prompt + seq.generated - seq.computed, budget)
            if chunk <= 0:
                continue
            budget -= chunk
            prefills.append((seq, chunk))
            need += self._ceil(seq.computed + chunk) - self._ceil(seq.computed)
        if need <= self._usable - self._used:
            self._used += need
        elif self.config.scheduling == "fcfs":
            prefills, budget = self._preempt_from_tail(prefills, budget, preempted)
        else:
            prefills, budget = self._schedule_with_preemption(preempted)
        if not preempted:
            budget = self._admit_waiting(budget, prefills)
        prefill_tokens = sum(chunk for _, chunk in prefills)
        context = self._decode_ctx_base + self._n_decode * self._g
        context += sum(seq.computed for seq, _ in prefills)
        seqs = self._n_decode + len(prefills)
        duration = self.config.latency.duration(prefill_tokens, seqs, context)
        self.iteration_tokens.observe(prefill_tokens + self._n_decode)
        self._in_flight = _InFlight(now, duration, prefills, self._n_decode, preempted, aborted)
        return duration

    def _preempt_from_tail(
        self, prefills: list[tuple[_Seq, int]], budget: int, preempted: list[str]
    ) -> tuple[list[tuple[_Seq, int]], int]:
        """FCFS preemption in O(victims): vLLM walks the running list in order and, when a
        sequence's new blocks do not fit, preempts the *last* running sequence until they
        do (or until it is the one preempted). The survivors are therefore the longest
        prefix of the running list whose new blocks fit in what is free plus what the
        preempted tail held, which is what popping the tail until the total fits gives."""
        chunks = {seq.request_id: chunk for seq, chunk in prefills}
        need_p = {
            rid: self._ceil(self._running[rid].computed + c)
            - self._ceil(self._running[rid].computed)
            for rid, c in chunks.items()
        }
        need = sum(need_p.values())
        while True:
            total = need + (self._phase_count[-self._g % self._bs] if self._n_decode else 0)
            if total <= self._usable - self._used or not self._running:
                break
            victim = next(reversed(self._running.values()))
            if victim.request_id in chunks:
                need -= need_p.pop(victim.request_id)
                budget += chunks.pop(victim.request_id)
            self._preempt(victim)
            preempted.append(victim.request_id)
        self._used += total
        kept = [(seq, c) for seq, c in prefills if seq.request_id in chunks]
        return kept, budget

    def _schedule_with_preemption(self, preempted: list[str]) -> tuple[list[tuple[_Seq, int]], int]:
        """Slow path: walk the running list in order, preempting from its tail (or the
        lowest priority) until each sequence's new blocks fit, as vLLM does."""
        by_priority = self.config.scheduling == "priority"
        budget = self.config.max_num_batched_tokens - self._n_decode
        scheduled: dict[str, tuple[_Seq, int, int]] = {}  # id -> (seq, chunk, blocks)
        order = list(self._running.values())
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            if seq.request_id not in self._running:
                continue  # preempted earlier in this walk
            if seq.state == _DECODE:
                computed, chunk = seq.prompt + seq.gbase + self._g - 1, 1
            else:
                computed = seq.computed
                chunk = min(seq.prompt + seq.generated - computed, budget)
                if chunk <= 0:
                    continue
            new_blocks = self._ceil(computed + chunk) - self._ceil(computed)
            while new_blocks > self._usable - self._used:
                victim = (
                    max(self._running.values(), key=lambda s: (s.priority, s.arrival))
                    if by_priority
                    else next(reversed(self._running.values()))
                )
                taken = scheduled.pop(victim.request_id, None)
                if taken is not None:  # priority mode may evict an already-scheduled seq
                    self._used -= taken[2]
                    if victim.state == _PREFILL:
                        budget += taken[1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is seq:
                    break
            if seq.state == _WAITING:  # it was preempted itself
                continue
            self._used += new_blocks
            if seq.state == _PREFILL:
                budget -= chunk
            scheduled[seq.request_id] = (seq, chunk, new_blocks)
        prefills = [(s, c) for s, c, _ in scheduled.values() if s.state == _PREFILL]
        left = self.config.max_num_batched_tokens - self._n_decode - sum(c for _, c in prefills)
        return prefills, left

    def _admit_waiting(self, budget: int, prefills: list[tuple[_Seq, int]]) -> int:
        cfg = self.config
        while budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting.peek()
            if seq is None:
                break
            todo = seq.prompt + seq.generated
            if not cfg.enable_chunked_prefill and todo > budget:
                break
            chunk = min(todo, budget)
            blocks = self._ceil(chunk)
            if blocks > self._usable - self._used:
                break
            self._waiting.pop()
            seq.state = _PREFILL
            self._running[seq.request_id] = seq
            self._prefilling[seq.request_id] = seq
            self._used += blocks
            budget -= chunk
            prefills.append((seq, chunk))
        return budget

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
            return result
        self.steps_total += 1
        self.busy_seconds_total += flight.duration
        if self.record_emissions and flight.decoding:
            result.emitted = [s.request_id for s in self._running.values() if s.state == _DECODE]
        if flight.decoding:
            self._g += 1
            self.generation_tokens_total += flight.decoding
            self.zombie_tokens_total += self._n_decode_zombie
            if self._last_step_end is not None:
                self.itl.observe(end - self._last_step_end, flight.decoding)
        for seq, chunk in flight.prefills:
            self._apply_prefill(seq, chunk, end, result)
        self._pop_finished(end, result)
        self._last_step_end = end
        return result

    def _apply_prefill(self, seq: _Seq, chunk: int, end: float, result: StepResult) -> None:
        start = seq.computed
        seq.computed += chunk
        if start < seq.max_computed:
            self.recomputed_tokens_total += min(seq.computed, seq.max_computed) - start
        if seq.computed < seq.prompt + seq.generated:
            return
        # Prefill (or re-prefill) done: this step samples the next token.
        del self._prefilling[seq.request_id]
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
        self._enter_decode(seq)

    def _enter_decode(self, seq: _Seq) -> None:
        seq.state = _DECODE
        seq.gbase = seq.generated - self._g
        seq.phase = (seq.prompt + seq.gbase - 1) % self._bs
        self._phase_count[seq.phase] += 1
        self._decode_ctx_base += seq.prompt + seq.gbase - 1
        self._n_decode += 1
        if seq.gone:
            self._n_decode_zombie += 1
        heapq.heappush(self._finish_heap, (seq.target - seq.gbase, seq.order, seq))

    def _leave_decode(self, seq: _Seq) -> None:
        """Materialise a decoding sequence's counts and take it out of the aggregates."""
        seq.generated = seq.gbase + self._g
        seq.computed = seq.prompt + seq.generated - 1
        self._phase_count[seq.phase] -= 1
        self._decode_ctx_base -= seq.prompt + seq.gbase - 1
        self._n_decode -= 1
        if seq.gone:
            self._n_decode_zombie -= 1

    def _pop_finished(self, end: float, result: StepResult) -> None:
        heap = self._finish_heap
        while heap and heap[0][0] <= self._g:
            _, _, seq = heapq.heappop(heap)
            if seq.state != _DECODE or seq.target - seq.gbase != self._g:
                continue  # stale entry: the sequence was preempted or aborted since
            self._leave_decode(seq)
            seq.last_token_at = end
            self._release(seq)
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
            if seq.state == _WAITING:
                seq.state = _DONE
                self._waiting.discard(seq)
                del self._seqs[rid]
            else:
                if seq.state == _DECODE:
                    self._leave_decode(seq)
                else:
                    del self._prefilling[rid]
                self._release(seq)
            done.append(rid)
        self._pending_aborts.clear()
        return done

    def _release(self, seq: _Seq) -> None:
        """Free a running sequence's blocks and forget it."""
        self._used -= self._ceil(seq.computed)
        seq.state = _DONE
        del self._running[seq.request_id]
        del self._seqs[seq.request_id]

    def _preempt(self, seq: _Seq) -> None:
        """Recompute-mode preemption: free everything, back to the head of the queue."""
        if seq.state == _DECODE:
            self._leave_decode(seq)
        else:
            del self._prefilling[seq.request_id]
        self._used -= self._ceil(seq.computed)
        seq.max_computed = max(seq.max_computed, seq.computed)
        seq.computed = 0
        seq.state = _WAITING
        seq.preemptions += 1
        seq.uncounted_preemptions += 1
        self.preemptions_evicted += 1
        del self._running[seq.request_id]
        self._waiting.push_front(seq)

    def _blocks_of(self, seq: _Seq) -> int:
        if seq.state == _DECODE:
            return self._ceil(seq.prompt + seq.gbase + self._g - 1)
        return self._ceil(seq.computed)

    def _ceil(self, tokens: int) -> int:
        return -(-tokens // self._bs)
