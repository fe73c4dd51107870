"""What admission knows about one request: its cost, priority, tenant and where it may go.

The shell builds one `AdmissionRequest` per client request, once the request is parsed,
costed and its candidate nodes known, and hands it to the core's flow controller; every
answer (admit now, wait, refuse) and every ticket refers back to it. It is immutable: a
retry on other nodes is a copy (`dataclasses.replace`) naming them, and so is a waiting
request re-costed when a better count of its prompt arrives
(`kvgate.core.flow.FlowController.recost`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Priority(enum.IntEnum):
    """Lower value = more important. Served first, shed last."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2

    @classmethod
    def parse(cls, text: str | None) -> Priority:
        """Parse an `X-Kvgate-Priority` header value; raises ValueError when unknown."""
        if not text:
            return cls.STANDARD
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown priority {text!r}: expected critical, standard or sheddable"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class RequestCost:
    """The KV-cache tokens a request may hold at its peak: prompt plus all it may generate.

    `prompt_tokens` leans long (under-counting a prompt is the unsafe error for admission);
    `prompt_floor` is the fewest it can plausibly be (exact counts, or text at its usual
    ratio without the safety factor), for refusals that say a request can never fit.
    `open_output`: the client named no output cap, so `max_output_tokens` is the engine's
    own limit (the rest of the context, or a fixed default), not an amount anyone asked for.
    `prompt_exact`: `prompt_tokens` is the engine's own count (token ids, the model's
    tokenizer or the engine's `/tokenize`), not an estimate.
    """

    prompt_tokens: int
    max_output_tokens: int
    prompt_floor: int | None = None
    open_output: bool = False
    prompt_exact: bool = False

    @property
    def floor_total(self) -> int:
        """The fewest tokens the request may need at its end: its prompt and the output it
        asked for (a token, when it named no cap: a request is never refused for an
        output nobody asked for)."""
        floor = self.prompt_tokens if self.prompt_floor is None else self.prompt_floor
        output = min(1, self.max_output_tokens) if self.open_output else self.max_output_tokens
        return floor + output

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


DEFAULT_TENANT = ""


@dataclass(frozen=True, slots=True, eq=False)
class AdmissionRequest:
    """One request as admission sees it. Identity, not value, makes two requests equal.

    `exact_output` says the request will generate exactly `max_output_tokens` (it asked the
    engine to ignore end-of-sequence), so the envelope need not predict its length.
    `max_wait_s` is the client's own bound on queueing (None: the priority's default; the
    client may lower it, never raise it). `candidates` are the node ids that serve its model.
    `timeout_s` is the client's own timeout for this try, when it says (the OpenAI SDKs
    send theirs): it gives up unless its answer has ended within it (a `stream`: unless
    its first bytes came within it). `answer_timeout_s` is the time a proxy in front gives
    the whole answer, streamed or not (Envoy's route timeout; kvgate.core.flow.patience).

    `prompt_ids`: the prompt's token ids as the engine will see them (chat template and
    special tokens applied), when they are known: from token ids in the body, the model's
    tokenizer or the engine's `/tokenize`; None otherwise (an estimate, a batch of several
    prompts). A tuple, so that slices of it (a KV block's worth) hash as they are. Its
    length is the prompt's exact count; an exact count known without ids is
    `cost.prompt_exact` with `prompt_ids` None.
    """

    request_id: str
    cost: RequestCost
    priority: Priority = Priority.STANDARD
    tenant: str = DEFAULT_TENANT
    model: str = ""
    candidates: tuple[str, ...] = ()
    exact_output: bool = False
    max_wait_s: float | None = None
    timeout_s: float | None = None
    answer_timeout_s: float | None = None
    stream: bool = False
    prompt_ids: tuple[int, ...] | None = None
