"""KV cost of a request: its prompt tokens plus every token it may generate.

Public API::

    estimator = CostEstimator(settings)
    basis = estimator.basis(model, body, context)       # -> CostBasis (raises CostError)
    basis = basis.with_count(count)                     # an exact count, when one exists
    cost = estimator.price(basis)                       # -> RequestCost
    estimator.learn(basis, usage["prompt_tokens"])      # -> True when the ratio moved

Prompt tokens are exact where anything counted them: token ids in the body, or a
`PromptCount` from the model's tokenizer or the engine (the shell's work, handed in as
`count`). Only what is still text is estimated, from the model's learned characters per
token (`kvgate.core.cost.ratios`), multiplied by `prompt_safety_factor`, because
under-estimating a prompt is the one error the reservation accounting cannot absorb before
the request's first token.

The output side is `max_completion_tokens` (chat), else `max_tokens`, multiplied by the
number of sequences the request asks for (`n`, `best_of`, and the number of prompts in a
batched completion), since each sequence grows its own KV blocks. A request that names no
cap gets what its engine generates without one: a fixed amount where the engine has one
(`implicit_output`: vLLM's completions stop at OpenAI's 16), else, with the model's context
length (`context`, when the engines list it), the rest of the context after the prompt's
floor (`RequestCost.open_output`: vLLM's chat completions go that far), and without a
context `default_max_tokens`, which the shell then sends upstream as its cap. With a
context no sequence holds more than it. How long a request really runs is planned by the
output lengths learned per model (`kvgate.core.lengths`).
"""

from __future__ import annotations

import math
from typing import Any

from kvgate.core.cost.basis import CostBasis, PromptCount, measure
from kvgate.core.cost.ratios import CharRatios
from kvgate.core.request import RequestCost
from kvgate.core.settings import AdmissionSettings

# Characters per token of typical English text: what a prompt's length is judged by against a
# context limit before the model's own ratio has been learned.
TYPICAL_CHARS_PER_TOKEN = 4.0


class CostEstimator:
    """Costs requests from their bases, and learns each model's characters per token."""

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        self.tuning = settings.tuning
        t = self.tuning
        self.ratios = CharRatios(t.chars_per_token, t.chars_per_token_min, t.chars_per_token_max)

    # --- costing --------------------------------------------------------------------------

    def basis(
        self,
        model: str,
        body: dict[str, Any],
        context: int | None = None,
        implicit_output: int | None = None,
    ) -> CostBasis:
        """What `body` is made of (see `kvgate.core.cost.basis.measure`); raises CostError."""
        return measure(model, body, context, implicit_output)

    def estimate(
        self,
        model: str,
        body: dict[str, Any],
        context: int | None = None,
        *,
        count: PromptCount | None = None,
        implicit_output: int | None = None,
    ) -> RequestCost:
        """The request's cost in one call (its basis, with `count` when given, priced)."""
        basis = measure(model, body, context, implicit_output)
        return self.price(basis if count is None else basis.with_count(count))

    def price(self, basis: CostBasis) -> RequestCost:
        """The cost of `basis` at the model's current ratio."""
        exact = basis.exact_tokens
        chars = basis.chars
        copies = basis.copies
        # Each of the `n` sequences may hold its own copy of the prompt (no prefix cache).
        tokens = exact * copies
        floor = tokens
        if chars:
            ratio = self.ratios.ratio(basis.model)
            approx = math.ceil(chars / ratio * self.tuning.prompt_safety_factor)
            tokens = (exact + approx) * copies
            floor = (exact + int(chars / max(ratio, TYPICAL_CHARS_PER_TOKEN))) * copies
        sequences = copies * len(basis.parts)
        # A body that names no cap is open: its cap is the engine's, not the client's.
        open_output = basis.asked is None
        asked = basis.implicit_output if open_output else basis.asked
        if basis.context is None:
            output = (self.settings.default_max_tokens if asked is None else asked) * sequences
        else:
            # The engine stops each sequence at the context: what they may generate is at
            # most the context less their prompts, which hold at least the floor.
            room = max(0, basis.context * sequences - floor)
            output = room if asked is None else min(asked * sequences, room)
        return RequestCost(tokens, output, floor, open_output=open_output, prompt_exact=not chars)

    def longest_prompt(self, basis: CostBasis) -> tuple[int, bool]:
        """The tokens of the basis's longest prompt, and whether that count is exact.

        What an engine compares with its context limit: each prompt of a batch alone (and
        `n` copies of one prompt are one prompt). Counted tokens are exact; text is
        converted at the model's learned ratio *without* `prompt_safety_factor` (and, before
        the ratio is learned, at the typical 4 characters per token rather than the
        estimator's cautious start): both keep reservations on the safe side, and must not
        make a prompt look longer than it is to a check that refuses it for its length.
        """
        ratio = self.ratios.learned(basis.model) or TYPICAL_CHARS_PER_TOKEN
        longest, exact = 0, True
        for tokens, chars in basis.parts:
            counted = tokens + (math.ceil(chars / ratio) if chars else 0)
            if counted > longest:
                longest, exact = counted, chars == 0
        return longest, exact

    # --- learning -------------------------------------------------------------------------

    def learn(self, basis: CostBasis, prompt_tokens: int) -> bool:
        """The engine counted `prompt_tokens` for the prompts of `basis` (its
        `usage.prompt_tokens`, or an exact count made for it): move the model's ratio
        towards what its text really made. True when the ratio moved enough that costs made
        at the old one are worth redoing.

        Engines count each prompt once in `usage`, whatever `n`; only the estimated share
        teaches (exact parts are subtracted), and a basis with no text left teaches nothing.
        """
        chars = basis.chars
        if not chars or prompt_tokens <= 0:
            return False
        return self.ratios.observe(basis.model, chars, prompt_tokens - basis.exact_tokens)

    def ratio(self, model: str) -> float:
        """The current characters-per-token ratio for `model`."""
        return self.ratios.ratio(model)
