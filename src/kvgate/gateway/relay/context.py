"""The engines' context limit, checked before admission: what the engine would refuse for
its length is refused here at once, and never sent.

The limit is the model's `max_model_len`, the largest among the backends serving it
(`ModelCatalog.max_model_len`; unknown when one of them does not list it, and then nothing
is checked). The refusals are the ones vLLM makes, with its messages and `param` (read
from vLLM 0.32's answers), as kvgate's own errors: `code` and `X-Kvgate-Reason`
`context_length_exceeded` (OpenAI's code for it), type `invalid_request_error`. A 400 an
engine makes itself (where the limit is unknown) is relayed as the engine sent it:

- `max_tokens` above the limit (`max_completion_tokens` where a chat request sends it,
  which vLLM then reads instead);
- a prompt longer than the limit (`param: input_tokens`), unless the request asks vLLM to
  cut it (`truncate_prompt_tokens`).

A prompt that fits but leaves less room than `max_tokens` asks for is not refused: vLLM
serves it, with the output cut at the limit.

A prompt counted exactly (token ids, the model's tokenizer, the engine's `/tokenize`) is
refused when its count exceeds the limit; an estimated one only when the estimate
*without* its safety margin does: the margin is there to keep reservations safe, and a
request refused for its length can never be served, so the doubt goes to the request (the
engine still has the last word).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvgate.core.cost import CostBasis
from kvgate.core.request import RequestCost
from kvgate.gateway.http.errors import GatewayError

#: The code (and `X-Kvgate-Reason`) of a request that cannot fit the model's context.
CONTEXT_LENGTH = "context_length_exceeded"


class PromptLength(Protocol):
    """What the check needs of `kvgate.core.cost.CostEstimator`."""

    def longest_prompt(self, basis: CostBasis) -> tuple[int, bool]: ...


def check_context(
    limit: int | None,
    body: dict[str, Any],
    cost: RequestCost,
    estimator: PromptLength,
    basis: CostBasis,
) -> None:
    """Raise the engine's 400 if the request cannot fit `limit` tokens of context."""
    if limit is None:
        return
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    if isinstance(asked, int) and asked > limit:
        raise too_many_output_tokens(key, asked, limit)
    # Fast path: the whole costed prompt, margin and every sequence included, fits.
    if cost.prompt_tokens <= limit or body.get("truncate_prompt_tokens") is not None:
        return
    tokens, exact = estimator.longest_prompt(basis)
    if tokens > limit:
        raise prompt_too_long(tokens, limit, exact)


def prompt_too_long(tokens: int, limit: int, exact: bool = True) -> GatewayError:
    """vLLM's answer to a prompt longer than the context (`about` when estimated)."""
    count = f"{tokens}" if exact else f"about {tokens}"
    return _engine_error(
        f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains {count} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt.",
        "input_tokens",
        tokens,
    )


def too_many_output_tokens(key: str, asked: int, limit: int) -> GatewayError:
    """vLLM's answer to an output cap above the context."""
    return _engine_error(
        f"{key}={asked} cannot be greater than max_model_len={limit}. "
        f"Please request fewer output tokens.",
        key,
        asked,
    )


def _engine_error(message: str, param: str, value: int) -> GatewayError:
    return GatewayError(
        400, f"{message} (parameter={param}, value={value})", CONTEXT_LENGTH, param=param
    )
