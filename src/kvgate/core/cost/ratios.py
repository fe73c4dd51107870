"""Characters per token, per model, learned from every exact count of a text prompt.

The ratio is the last fallback of prompt counting (kvgate.core.cost.estimator): it costs
the text of a model that has neither a tokenizer nor an engine that counts for it. It
starts at a cautious prior (`Tuning.chars_per_token`, 3: the first requests are
over-counted, not under-) and learns from each observation of characters against the
tokens the engine counted for them: the engine's `usage.prompt_tokens` when a request
ends, or an exact count that arrived while the request was costed.

It is a ratio of sums, not an average of ratios: each model keeps the characters and the
tokens it has seen, both decayed by `KEEP` per observation, and its ratio is their
quotient (clamped to [`chars_per_token_min`, `chars_per_token_max`]). The first
observation replaces the prior outright (a measurement beats a guess), later ones move it
by their share of the recent text, so a long prompt weighs more than a short one and the
last few dozen thousand characters decide.
"""

from __future__ import annotations

# Weight kept by what was seen before, per new observation: the last ~5 prompts decide.
KEEP = 0.8
# A change of the ratio smaller than this share is not worth re-costing waiters for.
MOVED = 0.02


class CharRatios:
    """Per-model characters per token; see the module docstring."""

    def __init__(self, prior: float, low: float, high: float) -> None:
        self.prior = prior
        self.low = low
        self.high = high
        self._sums: dict[str, tuple[float, float]] = {}  # model -> (characters, tokens)
        self._ratios: dict[str, float] = {}

    def ratio(self, model: str) -> float:
        """The model's current ratio (the prior until something was observed)."""
        return self._ratios.get(model, self.prior)

    def learned(self, model: str) -> float | None:
        """The model's ratio if anything was observed for it, else None."""
        return self._ratios.get(model)

    def observe(self, model: str, chars: int, tokens: int) -> bool:
        """`chars` characters made `tokens` tokens; True when the ratio moved by more than
        `MOVED` (worth re-costing what was costed at the old one)."""
        if chars <= 0 or tokens <= 0:
            return False
        seen_chars, seen_tokens = self._sums.get(model, (0.0, 0.0))
        seen_chars = KEEP * seen_chars + chars
        seen_tokens = KEEP * seen_tokens + tokens
        self._sums[model] = (seen_chars, seen_tokens)
        before = self.ratio(model)
        after = min(self.high, max(self.low, seen_chars / seen_tokens))
        self._ratios[model] = after
        return abs(after - before) > MOVED * before

    def snapshot(self) -> dict[str, float]:
        return {model: round(ratio, 3) for model, ratio in self._ratios.items()}
