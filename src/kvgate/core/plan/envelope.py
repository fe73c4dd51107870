"""The KV envelope: a node's future KV usage from what runs on it now, and its peak.

Every running request grows by one token per decode step until it has generated what it
is expected to, then frees everything it holds. With `base` the tokens the node holds now
and, for each running request k, `c_k` the tokens it holds now and `R_k` the steps it still
has to run, the usage `s` steps from now is

    U(s) = base + s * #{k : R_k > s} - sum(c_k : R_k <= s)

(growth of the live ones, minus what the ended ones held before they grew). U rises
linearly between two ends and drops at each, so its maximum over the future, the *peak*,
is `base` or its value just before some end:

    U(R_j-) = base + R_j * #{k : R_k >= R_j} - sum(c_k : R_k < R_j).

A newcomer with prompt `c0` expected to run `R0` steps adds `c0 + s` while `s < R0`. Sorting
the running requests by `R` makes the peak with a newcomer O(n): one pass over the ends.

Which errors are safe. Over-estimating a request's remaining steps or under-estimating what
it holds now can only raise the computed peak: growth is counted longer and the end frees
less. The callers lean that way: output not yet seen is counted as not generated, and a
request that outlives its expected length is expected to run to its `max_tokens`. An
envelope of the same requests taken before they grew, with its base raised by what they
grew since, counts each request's growth from the older point and frees less at its end:
it too can only be higher, as long as no request's expected length changed meanwhile.

`start_step` answers the scheduling question: how many steps from now until a newcomer of
final size `F0` fits under a limit, i.e. the first end after which the peak of everything
still running plus `F0` stays within it. It bounds the newcomer by its final size at every
instant, so it may answer a little later than the exact earliest start, never earlier.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class Envelope:
    """One node's running requests as (remaining steps, tokens held now), sorted by steps."""

    __slots__ = ("_held", "_prefix", "_steps", "_total_held", "base")

    def __init__(self, base: float, loads: Iterable[tuple[float, float]] = ()) -> None:
        self.base = base
        pairs = sorted(loads)
        self._steps = [r for r, _ in pairs]
        self._held = [c for _, c in pairs]
        self._total_held = sum(self._held)
        self._prefix: list[float] | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, held: float, steps: float) -> None:
        """A request admitted now: it holds `held` tokens and runs `steps` more steps."""
        i = bisect.bisect_right(self._steps, steps)
        self._steps.insert(i, steps)
        self._held.insert(i, held)
        self._total_held += held
        self.base += held
        self._prefix = None

    def floor(self, held: float = 0.0, steps: float = 0.0) -> float:
        """An O(1) lower bound of `peak(held, steps)`: now, and the newcomer at its end once
        everything running has ended (it can only be fuller then: it grew, they went)."""
        return max(self.base + held, self.base - self._total_held + held + steps)

    def peak(self, held: float = 0.0, steps: float = 0.0) -> float:
        """The highest future usage with a newcomer holding `held` and running `steps` more
        (none with the defaults)."""
        steps_list, held_list = self._steps, self._held
        n = len(steps_list)
        base = self.base + held
        best = base
        freed = 0.0  # held by the requests that ended before the current end
        i = 0
        new_pending = held > 0 or steps > 0
        while i < n:
            end = steps_list[i]
            if new_pending and steps <= end:
                # Just before the newcomer's own end: it holds held + steps.
                value = base + steps * (n - i + 1) - freed
                best = max(best, value)
                new_pending = False
                base -= held  # it has ended: later ends no longer count it
            value = base + end * (n - i) - freed
            if new_pending:
                value += end  # the newcomer is still running: it grew by `end` too
            best = max(best, value)
            # Every request ending at this same step leaves together.
            while i < n and steps_list[i] == end:
                freed += held_list[i]
                i += 1
        if new_pending:
            best = max(best, base + steps - freed)
        return best

    def start_step(self, final: float, limit: float) -> float | None:
        """Steps from now until a newcomer that will hold at most `final` tokens fits under
        `limit`: 0 if it fits now, else the first end after which it fits; None if it does
        not fit even once everything running has ended."""
        if final + self.base_after_all() > limit:
            return None
        tail = self._suffix_peaks()
        steps_list = self._steps
        n = len(steps_list)
        if tail[0] + final <= limit:
            return 0.0
        i = 0
        while i < n:
            end = steps_list[i]
            while i < n and steps_list[i] == end:
                i += 1
            if tail[i] + final <= limit:
                return end
        return steps_list[-1] if n else 0.0

    def base_after_all(self) -> float:
        """What the node holds once every running request has ended."""
        return self.base - self._total_held

    def _suffix_peaks(self) -> list[float]:
        """tail[i]: the highest usage from the moment the first i requests (by end) have
        ended, i.e. right after end i-1 (tail[0]: from now)."""
        steps_list, held_list = self._steps, self._held
        n = len(steps_list)
        prefix = self._prefix
        if prefix is None:
            prefix = [0.0] * (n + 1)
            for k in range(n):
                prefix[k + 1] = prefix[k] + held_list[k]
            self._prefix = prefix
        tail = [0.0] * (n + 1)
        # After all have ended: constant.
        tail[n] = self.base - prefix[n]
        running_max = tail[n]
        for k in range(n - 1, -1, -1):
            # Just before request k ends (all requests from k on are still running).
            before_end = self.base + steps_list[k] * (n - k) - prefix[k]
            running_max = max(running_max, before_end)
            # Right after the previous end (the start of this interval) the usage is lower
            # than just before this end (it only rises in between), so the max from the
            # interval's start is the max of the interval's end and everything later.
            tail[k] = running_max
        return tail
