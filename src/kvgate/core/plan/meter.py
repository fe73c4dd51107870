"""What one engine shows of itself under kvgate's traffic: the inputs of its ceiling.

`NodeMeter` measures, per node, from the node's samples and from kvgate's own stream
timings (no I/O; every call takes `now` from the policy's clock):

- **prefill pace**, seconds per prompt token: each request's time to first token over its
  prompt (prompts of at least `PREFILL_MIN_PROMPT` tokens; a short prompt's first token is
  mostly one step). The estimate is the lower quartile of the last `PREFILL_WINDOW`: a
  request queued in the engine waits longer than its prefill, never less, so the low end
  is the engine's own pace. Before any such request it is a prior: a prompt token costs
  `1 / PRIOR_PREFILL_TOKENS_PER_STEP` of the node's decode step (measured on the
  calibrated CPU preset at 1/130 and the GPU preset at 1/175: the prior is 2-3x slower,
  the side on which preemption looks costlier than it is);
- **decode step**: the engine's mean inter-token latency per sample
  (`NodeSample.iteration_latency_s`) as an EWMA over `STEP_HALFLIFE_S`, and the node's
  *idle step*, what a decode step costs it without prefill: the lowest of its
  healthy-sample baseline and of the same EWMA over the samples taken while no prompt
  kvgate sent was waiting for its first token (a step that prefills a chunk of a long
  prompt is many decode steps long);
- **yield**: output tokens per second on the node, counted from kvgate's streams, and its
  recent peak (decaying over `PEAK_HALFLIFE_S`);
- **latency** as the users see it, the mean time per output token over the node's
  streams: the seconds its streams were open after their first token over the tokens they
  got, both decayed over `YIELD_HALFLIFE_S` (so a burst's start is not read as slowness).
  A preempted request's stall counts in full: it is a stream that gets nothing;
- **preemption's cost**: preemptions per second (the engine's counter), the tokens they
  recompute (estimated from the preempted requests' size: the engine preempts its newest
  request, so the node's newest holds), and the share of the engine's time that
  recomputation takes (`recompute_share`: recomputed tokens x prefill pace per second).

`recompute_s` prices one request's preemption: what re-prefilling it would cost, the
question `kvgate.core.plan.ceiling` asks of each request it could place above the cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvgate.core.rates import DecayingRate, Ewma

# Prompts shorter than this say little of the prefill pace (their first token is one step).
PREFILL_MIN_PROMPT = 256
PREFILL_WINDOW = 32
# Until measured, a prompt token is priced at this fraction of a decode step.
PRIOR_PREFILL_TOKENS_PER_STEP = 50.0
# A decode step assumed before the node reported any (an idle engine reports none).
PRIOR_STEP_S = 0.01
STEP_HALFLIFE_S = 2.0
YIELD_HALFLIFE_S = 2.0
# Tokens (decayed) the latency needs before it is judged.
TPOT_MIN_TOKENS = 20.0
PEAK_HALFLIFE_S = 30.0
RECOMPUTE_HALFLIFE_S = 5.0
# The shortest step and prefill pace taken for real (a clock's resolution, not an engine's).
MIN_STEP_S = 1e-6
MIN_PREFILL_S = 1e-9
# Preemptions seen within this long count as "preempting now".
PREEMPTING_S = 3.0


class NodeMeter:
    """One node's measured prefill pace, step, latency, yield and preemption cost."""

    __slots__ = (
        "_decode",
        "_fastest",
        "_pace",
        "_peak",
        "_peak_at",
        "_preempt_count",
        "_sampled_at",
        "_sorted",
        "latency",
        "preempted_at",
        "preemptions",
        "recompute",
        "recomputed_tokens",
        "stream_time",
        "tokens",
    )

    def __init__(self) -> None:
        self._pace: deque[float] = deque(maxlen=PREFILL_WINDOW)
        self._sorted: list[float] | None = None
        self.latency = Ewma(STEP_HALFLIFE_S)
        self._decode = Ewma(STEP_HALFLIFE_S)
        self._fastest: float | None = None
        self.tokens = DecayingRate(YIELD_HALFLIFE_S)
        self.stream_time = DecayingRate(YIELD_HALFLIFE_S)
        self._sampled_at: float | None = None
        self._peak = 0.0
        self._peak_at = 0.0
        self.preemptions = DecayingRate(RECOMPUTE_HALFLIFE_S)
        self.recompute = DecayingRate(RECOMPUTE_HALFLIFE_S)  # recompute seconds per second
        self.recomputed_tokens = 0.0
        self._preempt_count: float | None = None
        self.preempted_at = float("-inf")

    # --- what comes in ------------------------------------------------------------------------

    def first_token(self, prompt_tokens: int, ttft_s: float) -> None:
        """A request's first token came `ttft_s` after it was sent, with its prompt."""
        if prompt_tokens >= PREFILL_MIN_PROMPT and ttft_s >= prompt_tokens * MIN_PREFILL_S:
            self._pace.append(ttft_s / prompt_tokens)
            self._sorted = None

    def produced(self, now: float, tokens: int) -> None:
        """Requests on the node streamed `tokens` more output tokens by `now`."""
        if tokens > 0:
            self.tokens.add(now, tokens)
            rate = self.tokens.value(now)
            if rate >= self.peak_yield(now):
                self._peak, self._peak_at = rate, now

    def sampled(
        self,
        now: float,
        latency_s: float | None,
        preemptions_total: float | None,
        newest: Iterable[int],
        baseline_s: float | None,
        decoding_only: bool,
        streams: int,
    ) -> int:
        """Take one sample's latency and preemption counter; `newest` yields the sizes of
        the node's requests, newest first (the engine's next victims); `decoding_only`:
        no prompt was being prefilled since the last sample; `streams`: requests on the
        node past their first token. Returns the preemptions the sample adds."""
        last_at, self._sampled_at = self._sampled_at, now
        if last_at is not None and now > last_at and streams > 0:
            self.stream_time.add(now, streams * (now - last_at))
        if latency_s is not None and latency_s >= MIN_STEP_S:
            self.latency.update(now, latency_s)
            if decoding_only:
                value = self._decode.update(now, latency_s)
                if self._fastest is None or value < self._fastest:
                    self._fastest = value
        if baseline_s is not None and baseline_s >= MIN_STEP_S:
            self._fastest = baseline_s if self._fastest is None else min(self._fastest, baseline_s)
        if preemptions_total is None:
            return 0
        last, self._preempt_count = self._preempt_count, preemptions_total
        if last is None or preemptions_total <= last:
            return 0
        count = int(preemptions_total - last)
        tokens = 0
        taken = 0
        for size in newest:
            if taken >= count:
                break
            tokens += size
            taken += 1
        self.preemptions.add(now, count)
        self.recomputed_tokens += tokens
        self.recompute.add(now, tokens * self.prefill_s_per_token())
        self.preempted_at = now
        return count

    # --- what it says ---------------------------------------------------------------------------

    def tpot_s(self, now: float) -> float | None:
        """Seconds per output token over the node's streams (None: too few tokens yet)."""
        tokens = self.tokens.value(now)
        if tokens * YIELD_HALFLIFE_S < TPOT_MIN_TOKENS:
            return None
        return self.stream_time.value(now) / tokens

    def step_s(self) -> float:
        """The node's recent step (the engine's mean inter-token latency), else a prior."""
        value = self.latency.value
        return value if value is not None and value > 0 else PRIOR_STEP_S

    def idle_step_s(self) -> float:
        """The node's decode step without prefill: the lowest of its healthy baseline and
        of its decode-only step, else the prior."""
        return self._fastest if self._fastest is not None else PRIOR_STEP_S

    def prefill_s_per_token(self) -> float:
        """Seconds per prompt token: measured (lower quartile), else the prior."""
        if not self._pace:
            return self.idle_step_s() / PRIOR_PREFILL_TOKENS_PER_STEP
        ordered = self._sorted
        if ordered is None:
            ordered = self._sorted = sorted(self._pace)
        return ordered[(len(ordered) - 1) // 4]

    def prefill_measured(self) -> bool:
        return bool(self._pace)

    def recompute_s(self, tokens: float) -> float:
        """What recomputing a request that holds `tokens` would cost the engine."""
        return tokens * self.prefill_s_per_token()

    def yield_tok_s(self, now: float) -> float:
        return self.tokens.value(now)

    def peak_yield(self, now: float) -> float:
        """The highest recent yield, halving every `PEAK_HALFLIFE_S` since it was seen."""
        return float(self._peak * 0.5 ** (max(0.0, now - self._peak_at) / PEAK_HALFLIFE_S))

    def recompute_share(self, now: float) -> float:
        """The share of the engine's time recent preemptions cost in recomputation."""
        return self.recompute.value(now)

    def preempting(self, now: float) -> bool:
        return now - self.preempted_at <= PREEMPTING_S

    def snapshot(self, now: float) -> dict[str, float | bool | None]:
        return {
            "tpot_s": self.tpot_s(now),
            "prefill_s_per_token": self.prefill_s_per_token(),
            "prefill_measured": self.prefill_measured(),
            "step_s": self.step_s(),
            "idle_step_s": self.idle_step_s(),
            "yield_tok_s": self.yield_tok_s(now),
            "peak_yield_tok_s": self.peak_yield(now),
            "preemptions_per_s": self.preemptions.value(now),
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": self.recompute_share(now),
        }
