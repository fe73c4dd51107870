"""What the core knows about one engine: its last good sample, freshness, and health.

**States** (`NodeState.state`; what admission does in each is in `docs/operating.md`):

* `unknown` - never sampled and no streak of hard failures: nobody has heard from it.
* `ok`, `high`, `panic` - **fresh**: the last good sample is at most `stale_after_s` old
  and fewer than `Tuning.failures_to_stale` (10) scrapes in a row failed *hard*. The name is the
  node's watermark level.
* `lagging` - not fresh, but the engine showed life within the last `stale_after_s`: the
  gateway saw it produce tokens (`progress`), or its page answered (with a sample that
  was already old when it came: the page is slow) and no streak of hard failures
  followed; and the last good sample is at most
  `LAG_LIMIT_FACTOR` x `stale_after_s` old. The engine serves; only its metrics page is
  slow (vLLM renders it in the API server that streams the tokens, and under load it has
  stalled for seconds). Admission goes on from the last sample plus the gateway's own
  books for the node, at the same watermarks.
* `stale` - not fresh, no sign of life: the last word is too old to act on. While the
  last good sample is at most `LAG_LIMIT_FACTOR` x `stale_after_s` old and no streak of
  hard failures followed it, the node is only *late* (`is_late`): its page may be
  answering late because the engine's API server or the gateway's own host is busy, which
  delays pages and tokens alike. Requests for it wait for its next sample instead of a
  503 (kvgate.core.policies.adaptive); none is sent to it on the old sample.
* `dead` - not fresh, no sign of life, and its last `Tuning.failures_to_stale` scrapes failed
  hard.
* `thrashing` - fresh or lagging, but preempting (below).

A node takes new work (`usable`) only when fresh or lagging and not thrashing. Staleness
is judged by the age of the last good sample (stamped when its GET was *sent*) and by
hard failures (refused or reset connections, HTTP errors, unparseable pages), never by
slowness alone: a scrape that is slow but answers is a sample, a scrape abandoned because
it hung is a failure that is not hard (`fail(hard=False)`: counted, but it starts no
streak; the sample's age does the rest).

Thrashing (the engine is preempting and recomputing instead of making progress) is
detected from the sample stream, because the preemption counter lags (vLLM counts a
preemption only when the victim runs again):
  * `preemptions_total` grows;
  * at the panic watermark or above, `waiting` rises while `running` falls between two
    samples (a victim moved back to the queue). Below it the same pattern is a request that
    ended and another that arrived: admission plans nodes up to their ceilings, so a full
    but healthy node is the normal state, not a symptom;
  * neither of those two while the policy planned the node above its cache
    (`preemption_tolerated`, `kvgate.core.plan.ceiling`): preemption is then the plan's
    own, and what would make it thrashing is measured there (goodput falling, latency
    breaking, recomputation taking the engine's time), which takes the tolerance back;
  * for engines that export no preemption counter only: the iteration latency exceeds
    `thrash_latency_factor` times its healthy baseline while requests are waiting. With a
    counter this signal adds nothing but false alarms: a step that prefills a long prompt
    is many times slower than a decode step, and that is work, not thrashing.
The baseline is a slow EWMA over healthy samples only (KV below the high watermark, nothing
waiting, not thrashing). Once detected, thrashing lasts at least `thrash_hold_s` and until
a sample no longer shows it, so a node does not flap in and out of rotation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvgate.core.rates import DecayingMean, Ewma, RecentMin
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

# The longest iteration latency taken as a measurement: an engine step of an hour is a
# broken page, and the means it would enter overflow.
MAX_STEP_S = 3600.0
# Samples the latency baseline needs before it may declare thrashing.
MIN_BASELINE_SAMPLES = 20
# A lagging node is admitted to on its last sample only while that sample is at most this
# many `stale_after_s` old (10 s by default): long enough to ride out a metrics page that
# a busy API server renders in seconds (vLLM's stalled for 1.75-3.4 s under load) and the
# backed-off polls around it; short enough that load from outside the gateway, which its
# books cannot see, is heard of within seconds.
LAG_LIMIT_FACTOR = 10.0
# The engine's seconds per token are its scrapes' mean over this half-life, each weighing
# the intervals it rests on: a prefill that stalls every decode counts at its share of time,
# and a step that grows with the batch shows within a second or two (a departed replica's
# requests are aged at it: `kvgate.core.replicas.departed`). The least scrape mean is kept
# over STEP_FLOOR_SPAN_S: the decode step between two prefills.
STEP_HALFLIFE_S = 1.0
STEP_FLOOR_SPAN_S = 10.0

LEVEL_OK = "ok"
LEVEL_HIGH = "high"
LEVEL_PANIC = "panic"
STATE_UNKNOWN = "unknown"
STATE_LAGGING = "lagging"
STATE_STALE = "stale"
STATE_DEAD = "dead"
STATE_THRASHING = "thrashing"
#: Every value `NodeState.state` returns, from the best to the worst for admission.
STATES = (
    LEVEL_OK,
    LEVEL_HIGH,
    LEVEL_PANIC,
    STATE_LAGGING,
    STATE_THRASHING,
    STATE_STALE,
    STATE_DEAD,
    STATE_UNKNOWN,
)


@dataclass(slots=True)
class NodeState:
    node_id: str
    sample: NodeSample | None = None
    previous: NodeSample | None = None
    consecutive_failures: int = 0  # hard failures in a row (a good sample ends the streak)
    failures_total: int = 0  # every failed scrape, hard or not
    thrash_until: float = float("-inf")
    thrashing: bool = False
    level: str = LEVEL_OK
    latency_baseline: Ewma | None = None
    # Cached at each accepted sample (hot path): capacity in tokens (None: unknown) and
    # the reported used tokens (0 without a KV gauge).
    cap: int | None = None
    used: float = 0.0
    # When the gateway last saw this node produce tokens (`progress`), and when its last
    # good sample arrived (a slow page's arrives well after its `sampled_at`).
    progress_at: float = float("-inf")
    heard_at: float = float("-inf")
    # The engine's seconds per token from its samples' inter-token latency: the mean over
    # its recent windows, each weighing as many intervals as it rests on (`step_s`; None
    # until a sample reports one), and the least mean of the windows of the last
    # STEP_FLOOR_SPAN_S that held no prefill of the gateway's (`step_floor_s`: the decode
    # step itself; `decoding`: the last sample was taken with no prompt waiting for its
    # first token).
    step_s: float | None = None
    step_floor_s: float | None = None
    step_mean: DecayingMean = field(default_factory=lambda: DecayingMean(STEP_HALFLIFE_S))
    step_recent: RecentMin = field(default_factory=lambda: RecentMin(STEP_FLOOR_SPAN_S))
    decoding: bool = True
    # Reflected tokens of requests released since the last sample: in `used` if the sample
    # was rendered before the engine freed them, already gone from it if after.
    freed_unseen: int = 0
    # Set by the policy before each sample: preemption here is planned (the node was
    # planned above its cache, `kvgate.core.plan.ceiling`), so it is not thrashing.
    preemption_tolerated: bool = False

    def age(self, now: float) -> float | None:
        if self.sample is None:
            return None
        return max(0.0, now - self.sample.sampled_at)

    def is_fresh(self, now: float, settings: AdmissionSettings) -> bool:
        """The last good sample is young and scrapes are not failing hard."""
        if self.sample is None or self.consecutive_failures >= settings.tuning.failures_to_stale:
            return False
        return now - self.sample.sampled_at <= settings.stale_after_s

    def is_live(self, now: float, settings: AdmissionSettings) -> bool:
        """Fresh or lagging: admission may act on what it knows of the node."""
        return now <= self.live_until(settings)

    def live_until(self, settings: AdmissionSettings) -> float:
        """The last instant the node stays fresh or lagging if nothing new is heard (no
        sample, failure or progress); -inf when it is neither now."""
        sample = self.sample
        if sample is None:
            return float("-inf")
        stale_after = settings.stale_after_s
        if self.consecutive_failures < settings.tuning.failures_to_stale:
            fresh = sample.sampled_at + stale_after
            alive = max(self.progress_at, self.heard_at)
        else:  # its page now fails hard: only tokens seen flowing say it serves
            fresh, alive = float("-inf"), self.progress_at
        lagging = min(alive + stale_after, sample.sampled_at + LAG_LIMIT_FACTOR * stale_after)
        return max(fresh, lagging)

    def is_late(self, now: float, settings: AdmissionSettings) -> bool:
        """Neither fresh nor lagging, but heard from within the lag limit and not failing
        hard: its next sample may only be late, so requests wait for it."""
        sample = self.sample
        return (
            sample is not None
            and self.consecutive_failures < settings.tuning.failures_to_stale
            and now - sample.sampled_at <= LAG_LIMIT_FACTOR * settings.stale_after_s
            and not self.is_live(now, settings)
        )

    def usable(self, now: float, settings: AdmissionSettings) -> bool:
        """May new work go here at all: fresh or lagging, and not thrashing."""
        return not self.thrashing and now <= self.live_until(settings)

    def state(self, now: float, settings: AdmissionSettings) -> str:
        """One of `STATES` (see the module's docstring)."""
        if self.is_fresh(now, settings):
            return STATE_THRASHING if self.thrashing else self.level
        if self.is_live(now, settings):
            return STATE_THRASHING if self.thrashing else STATE_LAGGING
        if self.consecutive_failures >= settings.tuning.failures_to_stale:
            return STATE_DEAD
        return STATE_UNKNOWN if self.sample is None else STATE_STALE

    def snapshot(self, now: float, settings: AdmissionSettings) -> dict[str, Any]:
        """JSON-able state for `/admin/state`, `/metrics` and the dashboard."""
        sample = self.sample
        return {
            "state": self.state(now, settings),
            "fresh": self.is_fresh(now, settings),
            "live": self.is_live(now, settings),
            "usable": self.usable(now, settings),
            "late": self.is_late(now, settings),
            "level": self.level,
            "age_s": self.age(now),
            "progress_age_s": _since(self.progress_at, now),
            "heard_age_s": _since(self.heard_at, now),
            "consecutive_failures": self.consecutive_failures,
            "failures_total": self.failures_total,
            "step_s": self.step_s,
            "sample": None if sample is None else sample.as_dict(),
        }

    def progress(self, now: float) -> None:
        """The gateway saw a request on this node produce tokens at `now`: the engine
        serves, whatever its metrics page is doing."""
        if now > self.progress_at:
            self.progress_at = now

    def last_heard(self) -> float | None:
        return None if self.sample is None else self.sample.sampled_at

    def capacity(self, settings: AdmissionSettings) -> int | None:
        """KV capacity in tokens as the engine reports it (or its backend entry configures it)."""
        if self.sample is not None and self.sample.kv_capacity_tokens:
            return self.sample.kv_capacity_tokens
        return None

    def accept(
        self, sample: NodeSample, now: float, settings: AdmissionSettings, decoding: bool = True
    ) -> bool:
        """Take a new sample; False (ignored) when it is older than the one held.
        `decoding`: no prompt sent to the node is waiting for its first token now (a window
        that began and ended so is the engine's decode step, its floor).

        A sample that cannot be trusted (non-finite KV usage or time) counts as a failed
        scrape instead; out-of-range numbers are clamped (see `sanitize`).
        """
        clean = sanitize(sample, now)
        if clean is None:
            self.fail()
            return False
        sample = clean
        self.heard_at = max(self.heard_at, now)
        if self.sample is not None and sample.sampled_at < self.sample.sampled_at:
            return False
        self.previous, self.sample = self.sample, sample
        self.consecutive_failures = 0
        self.freed_unseen = 0
        self.cap = self.capacity(settings)
        usage = sample.kv_usage
        self.used = usage * self.cap if usage is not None and self.cap is not None else 0.0
        latency = sample.iteration_latency_s
        if latency is not None and latency > 0:
            at = sample.sampled_at
            self.step_mean.add(at, latency, sample.iteration_tokens or 1.0)
            if decoding and self.decoding:
                self.step_recent.add(at, latency)
            self.step_s = self.step_mean.value
            self.step_floor_s = self.step_recent.value(at)
        self.decoding = decoding
        self._update_thrashing(now, settings)
        return True

    def fail(self, hard: bool = True) -> None:
        """A scrape failed. `hard`: refused, HTTP error or garbage - it counts towards
        `failures_to_stale`; a scrape abandoned because it hung does not (slowness alone
        never makes a node stale: the age of its last sample does)."""
        self.failures_total += 1
        if hard:
            self.consecutive_failures += 1

    # --- thrashing ------------------------------------------------------------------------

    def _update_thrashing(self, now: float, settings: AdmissionSettings) -> None:
        sample = self.sample
        assert sample is not None
        tuning = settings.tuning
        if self.latency_baseline is None:
            self.latency_baseline = Ewma(tuning.latency_baseline_halflife_s)
        signal = self._thrash_signal(sample, settings)
        if signal:
            self.thrash_until = max(self.thrash_until, now + tuning.thrash_hold_s)
            self.thrashing = True
        elif self.thrashing and now >= self.thrash_until:
            self.thrashing = False
        healthy = (
            not self.thrashing
            and sample.waiting == 0
            and (sample.kv_usage is None or sample.kv_usage < settings.high_watermark)
        )
        if healthy and sample.iteration_latency_s is not None:
            self.latency_baseline.update(sample.sampled_at, sample.iteration_latency_s)

    def _thrash_signal(self, sample: NodeSample, settings: AdmissionSettings) -> bool:
        prev = self.previous
        # Without a KV gauge (llama.cpp) a finished request and a queued arrival in the same
        # interval look alike; such nodes are gated by their queue instead.
        full = sample.kv_usage is not None and sample.kv_usage >= settings.panic_watermark
        if prev is not None and not self.preemption_tolerated:
            if full and sample.waiting > prev.waiting and sample.running < prev.running:
                return True
            if (
                sample.preemptions_total is not None
                and prev.preemptions_total is not None
                and sample.preemptions_total > prev.preemptions_total
            ):
                return True
        baseline = self.latency_baseline
        return (
            sample.preemptions_total is None
            and sample.waiting > 0
            and sample.iteration_latency_s is not None
            and baseline is not None
            and baseline.value is not None
            and baseline.count >= MIN_BASELINE_SAMPLES
            and sample.iteration_latency_s > settings.tuning.thrash_latency_factor * baseline.value
        )


def _since(at: float, now: float) -> float | None:
    return None if at == float("-inf") else max(0.0, now - at)


def sanitize(sample: NodeSample, now: float) -> NodeSample | None:
    """The sample with impossible values made safe, or None when it is unusable.

    Adapters should never produce these, but a pushed sample or a broken page might:
    NaN/inf KV usage or sample time -> unusable; KV usage clamped to [0, 1]; a sample
    time in the future -> now (it must not keep a node fresh longer than it is); negative
    counts -> 0; a non-positive capacity -> unknown; a latency that is negative, not finite
    or past `MAX_STEP_S` -> unknown.
    """
    usage = sample.kv_usage
    at = sample.sampled_at
    if not math.isfinite(at) or (usage is not None and not math.isfinite(usage)):
        return None
    latency = sample.iteration_latency_s
    capacity = sample.kv_capacity_tokens
    fixed: dict[str, Any] = {
        "kv_usage": None if usage is None else min(1.0, max(0.0, usage)),
        "sampled_at": min(at, now),
        "running": max(0, sample.running),
        "waiting": max(0, sample.waiting),
        "kv_capacity_tokens": capacity if capacity is not None and capacity > 0 else None,
        "iteration_latency_s": (
            latency if latency is not None and 0 <= latency <= MAX_STEP_S else None
        ),
    }
    if all(getattr(sample, key) == value for key, value in fixed.items()):
        return sample
    return dataclasses.replace(sample, **fixed)


def next_level(level: str, usage: float, high: float, panic: float, hysteresis: float) -> str:
    """Watermark state with hysteresis: enter at the watermark, leave `hysteresis` below it."""
    if usage >= panic:
        return LEVEL_PANIC
    if level == LEVEL_PANIC and usage >= panic - hysteresis:
        return LEVEL_PANIC
    if usage >= high:
        return LEVEL_HIGH
    if level in (LEVEL_HIGH, LEVEL_PANIC) and usage >= high - hysteresis:
        return LEVEL_HIGH
    return LEVEL_OK
