"""How long a request will run: output lengths learned per model from finished requests.

The KV envelope needs each running request's expected output length. `max_tokens` bounds
it, and a request that asked the engine to ignore end-of-sequence runs exactly to it. For
the others the expectation is a high quantile (`QUANTILE`) of the outputs the same model
produced recently, never above the request's own `max_tokens`.

A request that stopped at its `max_tokens` says only that the model would have produced at
least that many tokens: its length is *censored*. The quantile is therefore read from the
Kaplan-Meier estimate of the lengths' distribution, in which a censored length counts
among the requests still running up to its cap and says nothing past it. A few short smoke
tests that ended at a cap of 5 tokens leave the quantile of long answers as it is, while
requests that keep running into their caps near the quantile keep it unknown.

Safe failure. Until a model has `MIN_SAMPLES` requests that ended on their own, and
whenever the estimate cannot reach the quantile (too many requests ran into their caps to
say where it lies), the expectation is `max_tokens` itself. A request that outlives its
expectation is expected to run to `max_tokens` from then on (the caller's rule:
`Hold.remaining`, `kvgate.core.plan.holds`). The remaining risk, a burst of requests that
all run long at once, is what the margin between the ceilings and a full cache, and the
gate that closes at the panic watermark on measured usage, are for.

Likely (`likely`). The plan's quantile says how long a request may run; when room is likely
to free is read from the median (`MEDIAN`) instead: the flow controller refuses a request
at arrival only when even an optimistic prediction misses its bound.

Known or guessed (`informed`). The plan takes `max_tokens` for a model it knows nothing
about; a prediction of *when* something ends must not (`kvgate.core.flow`: a prediction
made on a guess queues a request rather than refuse it). An expectation is informed when
the request is exact, when the quantile is known, or when `MIN_SAMPLES` requests of the
model ran at least as far as this request's `max_tokens` allows (they run to their caps).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from typing import NamedTuple

QUANTILE = 0.9
MEDIAN = 0.5
WINDOW = 512
MIN_SAMPLES = 16
MAX_MODELS = 256
_EPS = 1e-9
# With censored lengths in the window, its quantiles are recomputed after this share of it.
_RECOMPUTE = 32


class Learned(NamedTuple):
    """What a model's recent requests say: the quantile to plan for and the median (None:
    not known), how many finished, and the longest output any of them reached."""

    quantile: int | None
    median: int | None
    finished: int
    longest: int


_NOTHING = Learned(None, None, 0, 0)


class _History:
    __slots__ = ("capped", "order", "quantiles", "sorted", "unread")

    def __init__(self) -> None:
        self.order: deque[tuple[int, bool]] = deque()
        # (length, capped), ascending; at equal lengths the ended ones come first (a
        # request censored at t was still running when another ended at t).
        self.sorted: list[tuple[int, bool]] = []
        self.capped = 0
        self.quantiles: tuple[int | None, int | None] = (None, None)  # QUANTILE, MEDIAN
        self.unread = 0  # requests added since `quantiles` were computed

    def add(self, length: int, capped: bool) -> None:
        if len(self.order) >= WINDOW:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
            self.capped -= old[1]
        entry = (length, capped)
        self.order.append(entry)
        bisect.insort(self.sorted, entry)
        self.capped += capped

    def learned(self) -> Learned:
        """What the window says. The estimate walks the window when some lengths are
        censored, so it is recomputed once per `1/_RECOMPUTE` of the window's requests
        (every request while the window is small): one request moves it by little."""
        entries = self.sorted
        n = len(entries)
        self.unread += 1
        if self.unread >= n // _RECOMPUTE or not self.capped:
            self.quantiles = self._quantiles()
            self.unread = 0
        return Learned(*self.quantiles, n, entries[-1][0] if entries else 0)

    def _quantiles(self) -> tuple[int | None, int | None]:
        """The Kaplan-Meier `QUANTILE` and `MEDIAN`: the shortest lengths by which the
        estimated share of requests still running has fallen to `1 - QUANTILE` and half."""
        entries = self.sorted
        n = len(entries)
        if n - self.capped < MIN_SAMPLES:
            return None, None
        if not self.capped:  # nothing censored: the plain order statistics
            return _order(entries, QUANTILE), _order(entries, MEDIAN)
        high, half = 1.0 - QUANTILE + _EPS, 1.0 - MEDIAN + _EPS
        median: int | None = None
        running = 1.0  # estimated share still running past the current length
        at_risk = n
        i = 0
        while i < n:
            length = entries[i][0]
            ended = censored = 0
            while i < n and entries[i][0] == length:
                if entries[i][1]:
                    censored += 1
                else:
                    ended += 1
                i += 1
            if ended:
                running *= 1.0 - ended / at_risk
                if median is None and running <= half:
                    median = length
                if running <= high:
                    return length, median
            at_risk -= ended + censored
        return None, median


def _order(entries: list[tuple[int, bool]], level: float) -> int:
    """The smallest length at or below which a share `level` of `entries` lies."""
    return entries[max(0, math.ceil(level * len(entries) - _EPS) - 1)][0]


class OutputLengths:
    """Per-model expected output lengths; `learn` O(WINDOW), `expected` O(1)."""

    def __init__(self) -> None:
        self._models: OrderedDict[str, _History] = OrderedDict()
        self._cache: dict[str, Learned] = {}

    def expected(self, model: str, max_tokens: int, exact: bool = False) -> int:
        """Output tokens to plan for: `max_tokens` when exact or not yet learnable."""
        if exact or max_tokens <= 0:
            return max_tokens
        q = self._cache.get(model, _NOTHING).quantile
        if q is None:
            return max_tokens
        return min(max_tokens, max(1, q))

    def likely(self, model: str, max_tokens: int, exact: bool = False) -> int:
        """Output tokens the request most likely makes: the median when known, else what
        `expected` plans for."""
        median = None if exact else self._cache.get(model, _NOTHING).median
        if median is None or max_tokens <= 0:
            return self.expected(model, max_tokens, exact)
        return min(max_tokens, max(1, median))

    def informed(self, model: str, max_tokens: int, exact: bool = False) -> bool:
        """Does `expected` rest on what the model's requests did, not on a guess (see the
        module docstring)?"""
        if exact or max_tokens <= 0:
            return True
        learned = self._cache.get(model, _NOTHING)
        if learned.quantile is not None:
            return True
        return learned.finished >= MIN_SAMPLES and learned.longest >= max_tokens

    def learned(self, model: str) -> Learned:
        """What the model's recent requests say (nothing for a model never seen)."""
        return self._cache.get(model, _NOTHING)

    def learn(self, model: str, max_tokens: int, output_tokens: int) -> None:
        """A request of `model` that finished normally produced `output_tokens`."""
        if output_tokens <= 0 or max_tokens <= 0:
            return
        history = self._models.get(model)
        if history is None:
            history = self._models[model] = _History()
            if len(self._models) > MAX_MODELS:
                gone, _ = self._models.popitem(last=False)
                self._cache.pop(gone, None)
        else:
            self._models.move_to_end(model)
        history.add(min(output_tokens, max_tokens), output_tokens >= max_tokens)
        self._cache[model] = history.learned()

    def snapshot(self) -> dict[str, int | None]:
        """The learned quantile per model (None: not learnable yet)."""
        return {model: learned.quantile for model, learned in self._cache.items()}
