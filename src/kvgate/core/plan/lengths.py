"""How long a request will run: output lengths learned per model from finished requests.

The KV envelope needs each running request's expected output length. `max_tokens` bounds
it, and a request that asked the engine to ignore end-of-sequence runs exactly to it. For
the others the expectation is a high quantile (`QUANTILE`) of the outputs the same model
produced recently, never above the request's own `max_tokens`.

Safe failure. Until a model has `MIN_SAMPLES` finished requests, and whenever more than
`1 - QUANTILE` of its recent requests stopped at their `max_tokens` (their true length is
unknown, so the quantile would be biased low), the expectation is `max_tokens` itself. A
request that outlives its expectation is expected to run to `max_tokens` from then on (the
caller's rule: `Hold.remaining`, `kvgate.core.plan.holds`). The remaining risk, a burst of
requests that all run long at once, is what the margin between the ceilings and a full
cache, and the gate that closes at the panic watermark on measured usage, are for.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque

QUANTILE = 0.9
WINDOW = 512
MIN_SAMPLES = 16
MAX_MODELS = 256


class _History:
    __slots__ = ("capped", "order", "sorted")

    def __init__(self) -> None:
        self.order: deque[tuple[int, bool]] = deque()
        self.sorted: list[int] = []
        self.capped = 0

    def add(self, length: int, capped: bool) -> None:
        if len(self.order) >= WINDOW:
            old, was_capped = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
            self.capped -= was_capped
        self.order.append((length, capped))
        bisect.insort(self.sorted, length)
        self.capped += capped

    def quantile(self) -> int | None:
        n = len(self.sorted)
        if n < MIN_SAMPLES or self.capped > (1.0 - QUANTILE) * n:
            return None
        return self.sorted[min(n - 1, int(QUANTILE * n))]


class OutputLengths:
    """Per-model expected output lengths; `learn` O(WINDOW), `expected` O(1)."""

    def __init__(self) -> None:
        self._models: OrderedDict[str, _History] = OrderedDict()
        self._cache: dict[str, int | None] = {}

    def expected(self, model: str, max_tokens: int, exact: bool = False) -> int:
        """Output tokens to plan for: `max_tokens` when exact or not yet learnable."""
        if exact or max_tokens <= 0:
            return max_tokens
        q = self._cache.get(model)
        if q is None:
            return max_tokens
        return min(max_tokens, max(1, q))

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
        self._cache[model] = history.quantile()

    def snapshot(self) -> dict[str, int | None]:
        """The learned quantile per model (None: not learnable yet)."""
        return dict(self._cache)
