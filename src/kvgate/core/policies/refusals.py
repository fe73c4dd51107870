"""Why the adaptive policy found no room for a request now, in the words its refusal uses.

Each candidate node answers with a `Fit` (`kvgate.core.policies.adaptive`): the headroom
left with the request on it, or why it does not fit there. When none fits, `no_room` names
the cause that stood closest to letting it start, in this order:

- `kv_panic`: every candidate holds its panic watermark (or is thrashing);
- `kv_planned_peak`: the KV peak the plan foresees with the request passes the request's
  ceiling. The plan counts what every running request will grow to (this one's output at
  its expected length included), so an engine holding 4% now may have no room for a
  request of 1,800 output tokens; the message names the planned peak, the ceiling and what
  the engine reports, on the candidate that came closest (`PlannedPeak`);
- `replica_claim`: other gateway replicas hold the rest of the room until their next sync;
- `wait_exceeded`: the room is promised to requests already waiting;
- `engine_queue`: the candidates have no KV gauge and requests wait in their own queues.

`RefusalMemo` keeps such refusals until anything changes, so a storm of refusals between two
samples costs O(1) each instead of a scan of every node.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.core.admission import PlannedPeak, Reject
from kvgate.core.nodes import NodeState
from kvgate.core.request import Priority


class Fit:
    """The outcome of checking one request against one node."""

    __slots__ = ("above", "headroom", "planned", "reason")

    def __init__(
        self,
        headroom: float | None,
        reason: str = "",
        planned: PlannedPeak | None = None,
        above: bool = False,
    ) -> None:
        self.headroom = headroom  # fraction of capacity left after it; None: does not fit
        self.reason = reason
        self.planned = planned  # reason "peak": the plan that refused it
        self.above = above  # it fits only with the node planned above its panic watermark


def planned_peak(node: NodeState, peak: float, limit: float) -> Fit:
    """No fit: the node's planned peak with the request, `peak` tokens, passes `limit`."""
    cap = node.cap or 1
    usage = None if node.sample is None else node.sample.kv_usage
    return Fit(None, "peak", PlannedPeak(node.node_id, peak / cap, limit / cap, usage))


def no_room(fits: Sequence[Fit], priority: Priority) -> tuple[str, str, PlannedPeak | None]:
    """The reason, message and closest planned peak of a refusal by the nodes that were
    heard from (`fits`: none stale or late), when not every one of them is thrashing."""
    reasons = {fit.reason for fit in fits}
    plans = [fit.planned for fit in fits if fit.planned is not None]
    best = min(plans, key=lambda p: p.peak - p.ceiling) if plans else None
    if "panic" in reasons and reasons <= {"panic", "thrashing"}:
        reason, message = (
            "kv_panic",
            (
                "The KV cache of every backend for this model is at its panic watermark; retry"
                " later."
            ),
        )
    elif best is not None:
        holds = "" if best.usage is None else f" (it holds {best.usage:.0%} now)"
        reason, message = (
            "kv_planned_peak",
            (
                f"No backend for this model has room for this request under the ceiling for"
                f" {priority.label} requests: with it, the KV peak planned on {best.node_id}"
                f" would reach {best.peak:.0%} of its cache{holds}, over its {best.ceiling:.0%}"
                " ceiling. The plan counts what every running request will grow to, this one"
                " included; retry later."
            ),
        )
    elif "share" in reasons:
        reason, message = (
            "replica_claim",
            (
                "The other gateway replicas hold the rest of the room on every backend for this"
                " model until their next sync; retry shortly."
            ),
        )
    elif "promised" in reasons:
        reason, message = (
            "wait_exceeded",
            (
                "The room on every backend for this model is promised to requests already"
                " waiting; retry later."
            ),
        )
    else:
        reason, message = (
            "engine_queue",
            ("Every backend for this model has requests waiting in its own queue; retry later."),
        )
    return reason, message, best if reason == "kv_planned_peak" else None


_MEMO_KEYS = 256
_MEMO_SIZES = 8
MemoKey = tuple[Priority, tuple[str, ...]]


class RefusalMemo:
    """Waitable refusals per (priority, candidates), valid while the policy's generation
    stands (no sample, start, end or node change since) and until a node they counted on
    goes stale."""

    def __init__(self, overhead: int) -> None:
        self.overhead = overhead
        self._memo: dict[MemoKey, tuple[int, float, list[tuple[int, int, Reject]]]] = {}

    def recall(
        self, generation: int, now: float, key: MemoKey, held: int, expected: int
    ) -> Reject | None:
        """A refusal of a request no larger than this one, made since anything changed:
        it holds for this one too (it needs at least as much room, on the same nodes), if
        that one was no cheaper to preempt (`kvgate.core.plan.ceiling.cheap` rises with the
        prompt's share: it has no higher ceiling anywhere)."""
        memo = self._memo.get(key)
        if memo is None or memo[0] != generation or now >= memo[1]:
            return None
        ovh = self.overhead
        for smaller_held, smaller_expected, refusal in memo[2]:
            if (
                smaller_held <= held
                and smaller_expected <= expected
                and (smaller_held - ovh) * expected <= (held - ovh) * smaller_expected
            ):
                return refusal
        return None

    def remember(
        self,
        generation: int,
        now: float,
        until: float,
        key: MemoKey,
        sizes: tuple[int, int],
        refusal: Reject,
    ) -> None:
        """Keep `refusal` of a request of `sizes` (held, expected) until `until` at most."""
        memo = self._memo.get(key)
        if memo is None or memo[0] != generation or now >= memo[1]:
            if len(self._memo) >= _MEMO_KEYS:
                self._memo.clear()
            memo = self._memo[key] = (generation, until, [])
        if len(memo[2]) < _MEMO_SIZES:
            memo[2].append((*sizes, refusal))
