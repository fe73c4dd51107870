"""Each node's planned-KV ceiling, set by what its engine measures (`kvgate.core.plan.meter`).

The rule: a protection costs nothing where the engine copes and acts where it cannot.
Preemption is the engine's business; collapse is kvgate's.

**Above the cache, for requests cheap to recompute.** The engine preempts its newest
request when its KV cache runs out, and recomputes it later. Where that recomputation is
cheap, a larger batch that sometimes preempts finishes sooner than a smaller one that never
does (the real CPU engine: a batch of 8-10 beats a batch of 3 on the same burst). Where it
is dear (a 100k-token prompt on a GPU: seconds of prefill), one preemption costs more than
the batch gains. So a request may be placed with the node's planned peak *above* the
panic watermark, up to `panic + overbook` of the capacity, only when

    recompute_s(prompt + expected output) <= CHEAP_SHARE x expected output x idle step

i.e. being preempted once would add at most `CHEAP_SHARE` to its own decode time, priced
at the node's measured prefill pace and decode step. Its prompt is what the node lacks: on
an engine with prefix caching the blocks other running requests hold stay cached when it
is preempted, and only its own part is prefilled again. Only such requests ever make the plan pass
the cache, and a request placed while it does is the engine's newest: the engine's victims
are the requests the rule chose. Whatever the rule, a request above the cache must fit the
cache *now* (its prompt next to what the node holds, every prompt sent counted whole), the
node's last sample must show nothing waiting in the engine, and the node must not be at
its panic level: the engine queues nothing kvgate could have kept. A waiter that may be
planned above the cache is predicted to start (`AdaptivePolicy.start_estimate`) once the
plan has room under its ceiling and the cache has freed room for its prompt.

Only an engine whose samples show its KV usage and count its preemptions (vLLM, SGLang)
is ever planned above its cache: elsewhere kvgate could neither see a preemption nor price
it. A request larger than the cache alone never is: no preemption makes it fit.

**The overbooking is earned.** `NodeCeiling` starts at `OVERBOOK_MAX` and comes down to
the watermarks (`overbook = 0`) on any of, judged at each sample:

- *latency breaks*: the time per output token the node's streams get (preempted requests'
  stalls included) passes the TPOT target of standard work, `TPOT_TARGET_STEPS` idle
  steps;
- *recomputation is costly*: recent preemptions take more than `RECOMPUTE_MAX_SHARE` of
  the engine's time in recomputation;
- *goodput falls*: the node is preempting with requests waiting in the engine while its
  yield is below `COLLAPSE_YIELD` of its recent peak.

It stays there `HOLD_S`, then regains the whole range over `RAMP_S` while none recurs.
Critical work is placed above the cache only while the latency meets its own, tighter
target (`CRITICAL_TARGET_STEPS`); sheddable work never is (it would become the newest,
preempted before the interactive work it is meant to leave room for).

**Thrashing stays a hard gate, redefined.** Preemptions while the node is planned above its
cache because of a request placed there (and for `TOLERANCE_S` after), and its overbooking
stands, are the plan's own: they are not thrashing (`tolerates_preemption`). Any other
preemption, and every preemption once a cut took the overbooking back, is thrashing as
before (`kvgate.core.nodes`): the node takes nothing new until it stops.
"""

from __future__ import annotations

from typing import Any

from kvgate.core.nodes import NodeState
from kvgate.core.plan.holds import Hold, Holds
from kvgate.core.plan.meter import NodeMeter
from kvgate.core.request import Priority
from kvgate.core.signals import NodeSample

# The planned peak may pass the panic watermark by this much of the capacity at most. What
# binds first on an engine that copes is the cache now (a request's prompt must fit it).
OVERBOOK_MAX = 3.0
# A request is cheap to preempt when recomputing it costs at most this share of its decode.
CHEAP_SHARE = 0.1
# Preemptions whose recomputation takes more than this share of the engine's time cost.
RECOMPUTE_MAX_SHARE = 0.2
# Yield below this share of the node's recent peak while preempting, work waiting: collapse.
COLLAPSE_YIELD = 0.5
# Latency targets (mean inter-token latency), in the node's idle decode steps.
TPOT_TARGET_STEPS = 10.0
CRITICAL_TARGET_STEPS = 5.0
HOLD_S = 10.0
RAMP_S = 20.0
TOLERANCE_S = 5.0

OVERBOOKING = "overbooking"
RAMPING = "ramping"
LATENCY = "latency"
RECOMPUTE = "recompute"
COLLAPSE = "collapse"
FIXED = "fixed"
#: Every reason a ceiling can give (`kvgate_node_ceiling_reason` lists them all).
REASONS = (OVERBOOKING, RAMPING, LATENCY, RECOMPUTE, COLLAPSE, FIXED)
UNMEASURABLE = "the engine's samples show no KV usage or no preemption counter"


class NodeCeiling:
    """One node's overbooking (a fraction of capacity above the panic watermark) and why."""

    __slots__ = ("_at", "detail", "held_until", "overbook", "overbooked_at", "reason")

    def __init__(self) -> None:
        self.overbook = OVERBOOK_MAX
        self.reason = OVERBOOKING
        self.detail = "not measured yet: preemption assumed cheap for cheap requests"
        self.held_until = float("-inf")
        self.overbooked_at = float("-inf")
        self._at: float | None = None

    def placed_above(self, now: float) -> None:
        """A request was just placed with the node planned above its panic watermark."""
        self.overbooked_at = now

    def planned(self, now: float, peak: float, panic: float) -> None:
        """The node's planned peak (a fraction of capacity) as of `now`: the overbooking
        lasts while the plan stays above the panic watermark."""
        if peak > panic and now - self.overbooked_at <= TOLERANCE_S:
            self.overbooked_at = now

    def tolerates_preemption(self, now: float) -> bool:
        """Preemption on the node is the overbooking's own (not thrashing)."""
        return self.overbook > 0 and now - self.overbooked_at <= TOLERANCE_S

    def judge(self, now: float, meter: NodeMeter, waiting: int) -> None:
        """One sample's verdict: cut to the watermarks on evidence, else regain."""
        # The overbooking is regained only over time past the hold.
        dt = 0.0 if self._at is None else max(0.0, now - max(self._at, self.held_until))
        self._at = now
        tpot, target = meter.tpot_s(now), TPOT_TARGET_STEPS * meter.idle_step_s()
        share = meter.recompute_share(now)
        yielded, peak = meter.yield_tok_s(now), meter.peak_yield(now)
        if meter.preempting(now) and waiting > 0 and yielded < COLLAPSE_YIELD * peak:
            self._cut(now, COLLAPSE, f"yield {yielded:.0f} tok/s, peak {peak:.0f}, preempting")
        elif share > RECOMPUTE_MAX_SHARE:
            self._cut(now, RECOMPUTE, f"recomputation takes {share:.0%} of the engine's time")
        elif tpot is not None and tpot > target:
            self._cut(now, LATENCY, f"TPOT {tpot * 1e3:.1f} ms > target {target * 1e3:.1f} ms")
        elif now >= self.held_until:
            self.overbook = min(OVERBOOK_MAX, self.overbook + OVERBOOK_MAX * dt / RAMP_S)
            self.reason = OVERBOOKING if self.overbook >= OVERBOOK_MAX else RAMPING
            shown = "-" if tpot is None else f"{tpot * 1e3:.1f}"
            self.detail = (
                f"recomputation {share:.0%} of the engine's time, TPOT {shown} ms"
                f" (target {target * 1e3:.1f} ms)"
            )

    def _cut(self, now: float, reason: str, detail: str) -> None:
        self.overbook = 0.0
        self.held_until = now + HOLD_S
        self.reason, self.detail = reason, detail

    def allows(self, now: float, priority: Priority, meter: NodeMeter) -> bool:
        """May a request of `priority` be placed above the cache here now."""
        if self.overbook <= 0 or priority is Priority.SHEDDABLE:
            return False
        if priority is Priority.CRITICAL:
            tpot = meter.tpot_s(now)
            return tpot is None or tpot <= CRITICAL_TARGET_STEPS * meter.idle_step_s()
        return True

    def snapshot(self) -> dict[str, Any]:
        return {"overbook": self.overbook, "reason": self.reason, "detail": self.detail}


def cheap(meter: NodeMeter, prompt_tokens: int, expected_output: int) -> bool:
    """Would one preemption of this request add at most `CHEAP_SHARE` to its decode time
    (at the node's idle step: what its decode costs without other prompts' prefill)."""
    decode_s = max(1, expected_output) * meter.idle_step_s()
    return meter.recompute_s(prompt_tokens + expected_output) <= CHEAP_SHARE * decode_s


def cheap_prompt_ratio(meter: NodeMeter) -> float:
    """The longest prompt, in output tokens, a cheap request may have on the node now."""
    return max(0.0, CHEAP_SHARE * meter.idle_step_s() / meter.prefill_s_per_token() - 1.0)


class _Node:
    __slots__ = ("control", "decoded", "measurable", "meter", "queued", "streams")

    def __init__(self) -> None:
        self.meter = NodeMeter()
        self.control = NodeCeiling()
        self.streams = 0  # requests past their first token
        self.decoded = False  # no prompt was waiting for its first token at the last sample
        self.measurable = False  # its samples show its KV usage and its preemptions
        self.queued = False  # its last sample showed requests waiting in the engine


class Ceilings:
    """Every node's meter and ceiling, fed by the policy's ticket and sample events."""

    __slots__ = ("_holds", "_nodes")

    def __init__(self, holds: Holds) -> None:
        self._holds = holds
        self._nodes: dict[str, _Node] = {}

    def _node(self, node_id: str) -> _Node:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node()
        return node

    def forget(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    # --- events ---------------------------------------------------------------------------------

    def first_token(self, hold: Hold, at: float) -> None:
        """The hold's request produced its first token at `at`."""
        node = self._node(hold.node_id)
        node.streams += 1
        node.meter.first_token(hold.prompt, at - hold.ticket.admitted_at)

    def produced(self, node_id: str, now: float, tokens: int) -> None:
        self._node(node_id).meter.produced(now, tokens)

    def streamed(
        self, hold: Hold, prefilled: bool, tokens: int, first_token_at: float | None, now: float
    ) -> None:
        """A stream event moved the hold on from `prefilled` and `tokens` output tokens: a
        first token, output, or both."""
        if not prefilled and hold.prefilled and first_token_at is not None:
            self.first_token(hold, first_token_at)
        if hold.tok_cur > tokens:
            self.produced(hold.node_id, now, hold.tok_cur - tokens)

    def ended(self, hold: Hold) -> None:
        """The hold's request ended (its hold is about to be released)."""
        node = self._nodes.get(hold.node_id)
        if node is not None and hold.prefilled:
            node.streams = max(0, node.streams - 1)

    def placed_above(self, node_id: str, now: float) -> None:
        self._node(node_id).control.placed_above(now)

    def planned(self, state: NodeState, now: float, peak: float, panic: float) -> None:
        """Before a sample: the node's planned peak, and whether a preemption the sample
        shows is the plan's own (`NodeState.preemption_tolerated`)."""
        control = self._node(state.node_id).control
        control.planned(now, peak, panic)
        state.preemption_tolerated = control.tolerates_preemption(now)

    def sampled(self, state: NodeState, now: float, sample: NodeSample) -> None:
        """Feed the node's meter one sample and let its ceiling judge."""
        node = self._node(state.node_id)
        holds = self._holds
        book = holds.books.get(state.node_id)
        newest = () if book is None else (holds.current(h) for h in reversed(book.holds.values()))
        baseline = None if state.latency_baseline is None else state.latency_baseline.value
        idle = holds.prefill_backlog(state.node_id) == 0
        node.meter.sampled(
            now,
            sample.iteration_latency_s,
            sample.preemptions_total,
            newest,
            baseline,
            idle and node.decoded,
            node.streams,
        )
        node.decoded = idle
        node.measurable = sample.kv_usage is not None and sample.preemptions_total is not None
        node.queued = sample.waiting > 0
        node.control.judge(now, node.meter, sample.waiting)

    # --- questions ----------------------------------------------------------------------------

    def overbook(self, node_id: str, priority: Priority, now: float) -> float:
        """How far above the panic watermark a cheap request of `priority` may take the
        node's planned peak now (0: not at all)."""
        node = self._nodes.get(node_id)
        if node is None or not node.measurable or node.queued:
            return 0.0
        if not node.control.allows(now, priority, node.meter):
            return 0.0
        return node.control.overbook

    def is_cheap(self, node_id: str, prompt_tokens: int, expected_output: int) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and cheap(node.meter, prompt_tokens, expected_output)

    def snapshot(self, node_id: str, now: float) -> dict[str, Any] | None:
        node = self._nodes.get(node_id)
        if node is None:
            return None
        control = node.control.snapshot()
        if not node.measurable:
            control.update(overbook=0.0, reason=FIXED, detail=UNMEASURABLE)
        return {
            **control,
            "cheap_prompt_ratio": cheap_prompt_ratio(node.meter),
            "measured": node.meter.snapshot(now),
        }
