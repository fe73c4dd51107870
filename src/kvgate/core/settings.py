"""Admission and queue settings (validated by pydantic), and the core's internal constants.

Every field's `description` ends up in the README's configuration reference
(`kvgate config-doc`), so keep them short and exact. Only what an operator has a reason to
change is a setting; the rest is `Tuning`: constants with a default argued next to each,
which tests and the simulator may vary through `AdmissionSettings.tuned()` but the
configuration file cannot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from kvgate.core.request import Priority

FailMode = Literal["closed", "open"]
BandName = Literal["critical", "standard", "sheddable", "total"]


@dataclass(frozen=True, slots=True)
class Tuning:
    """Internal constants of admission. Not configuration: each default is argued here."""

    # A sample is trusted to contain a request's prompt only this long after its first
    # token: one engine iteration of gauge lag plus a scrape's latency.
    reflect_margin_s: float = 0.1
    # Tokens added to each request's footprint: half a 32-token KV block of rounding.
    reservation_overhead_tokens: int = 16
    # Hard scrape failures in a row (refused, HTTP error, unparseable page) after which a
    # node is dead before `stale_after_s`; a slow page is not a failure. At the 50 ms
    # scrape period, 10 is half a second: an engine that is gone is out twice as fast as
    # by staleness alone, while a few refused connections of a restarting proxy are not.
    failures_to_stale: int = 10
    # A node leaves the high/panic level only this far below the watermark (no flapping).
    hysteresis: float = 0.03
    # Iteration latency this many times its healthy baseline, with requests waiting, is
    # thrashing; the baseline is a slow EWMA of healthy samples.
    thrash_latency_factor: float = 4.0
    latency_baseline_halflife_s: float = 30.0
    # A thrashing node stays out of rotation at least this long (about one preemption
    # cycle on a loaded engine).
    thrash_hold_s: float = 2.0
    # Half-life of the measured rate at which KV tokens are freed (predicts waits).
    release_rate_halflife_s: float = 5.0
    # From this many candidates on, placement looks at two random nodes, not all.
    p2c_min_nodes: int = 8
    # The prompt estimate, the last fallback of counting (kvgate.core.cost): initial
    # characters per token, its learned range, and the factor on estimated prompts
    # (under-counting a prompt is the unsafe error). English prose runs about 4 characters
    # per token, code and other languages fewer, and the random-token prompts of benchmark
    # clients about 2.5: start at 3, so that the first requests of a model are over-counted,
    # not under-, until the first exact count or `usage` of the model replaces it.
    chars_per_token: float = 3.0
    chars_per_token_min: float = 1.0
    chars_per_token_max: float = 8.0
    prompt_safety_factor: float = 1.1


class AdmissionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    high_watermark: float = Field(
        0.80,
        gt=0,
        lt=1,
        description="KV usage that `sheddable` work may fill a node to at its planned peak.",
    )
    panic_watermark: float = Field(
        0.92,
        gt=0,
        le=1,
        description="KV usage that no planned peak may pass; a node holding this much takes"
        " nothing new.",
    )
    stale_after_s: float = Field(
        1.0, gt=0, description="A node whose last good sample is older takes no new requests."
    )
    fail_mode: FailMode = Field(
        "closed",
        description=(
            "When no candidate node is fresh: `closed` answers 503 + Retry-After and never sends"
            " to nodes nobody has heard from; `open` sends to the candidate heard from most"
            " recently (never-observed nodes only if none was ever observed), without KV checks."
        ),
    )
    default_max_tokens: int = Field(
        1024,
        gt=0,
        description="Output cap assumed, and sent upstream, for a request that names none"
        " where the engines do not list the model's context length; where they do, such a"
        " request may generate up to the rest of the context (vLLM's chat completions do).",
    )
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="Model name -> its tokenizer: a model directory (tokenizer.json, and"
        " tokenizer_config.json with the chat template) or a tokenizer.json, for exact prompt"
        " counts in process. Models without one are counted by their vLLM engines'"
        " `/tokenize`, else estimated.",
    )

    _tuning: Tuning = PrivateAttr(default_factory=Tuning)

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> AdmissionSettings:
        if self.panic_watermark <= self.high_watermark:
            raise ValueError("panic_watermark must be above high_watermark")
        return self

    @property
    def tuning(self) -> Tuning:
        return self._tuning

    def tuned(self, **changes: float | int) -> AdmissionSettings:
        """A copy with some internal constants changed (tests, the simulator)."""
        copy = self.model_copy()
        copy._tuning = dataclasses.replace(self._tuning, **changes)  # type: ignore[arg-type]
        return copy


def _default_waits() -> dict[BandName, float]:
    return {"critical": 60.0, "standard": 60.0, "sheddable": 30.0}


def _default_waiting() -> dict[BandName, int | None]:
    return {"total": 4096}


def _default_waiting_tokens() -> dict[BandName, int | None]:
    return {"total": 16_000_000}


class QueueSettings(BaseModel):
    """The gateway's queue (`kvgate.core.flow`): how long and how much may wait."""

    model_config = ConfigDict(extra="forbid")

    max_wait_s: dict[BandName, float] = Field(
        default_factory=_default_waits,
        description="Longest wait per priority before a 429 (a request is refused at once"
        " only when a measured prediction says it cannot start within it;"
        " `X-Kvgate-Max-Wait-Ms` may lower it; 0: never wait). Priorities left out keep"
        " their defaults.",
    )
    max_waiting: dict[BandName, int | None] = Field(
        default_factory=_default_waiting,
        description="Waiting requests at most, per priority and in `total` (null: no cap)."
        " Entries left out keep their defaults.",
    )
    max_waiting_tokens: dict[BandName, int | None] = Field(
        default_factory=_default_waiting_tokens,
        description="KV tokens (prompt + max_tokens) waiting at most, per priority and in"
        " `total` (null: no cap). Entries left out keep their defaults.",
    )

    @field_validator("max_wait_s", mode="before")
    @classmethod
    def _waits_over_defaults(cls, value: Any) -> Any:
        return {**_default_waits(), **value} if isinstance(value, dict) else value

    @field_validator("max_waiting", mode="before")
    @classmethod
    def _waiting_over_defaults(cls, value: Any) -> Any:
        return {**_default_waiting(), **value} if isinstance(value, dict) else value

    @field_validator("max_waiting_tokens", mode="before")
    @classmethod
    def _tokens_over_defaults(cls, value: Any) -> Any:
        return {**_default_waiting_tokens(), **value} if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _positive(self) -> QueueSettings:
        for name, table in (
            ("max_wait_s", self.max_wait_s),
            ("max_waiting", self.max_waiting),
            ("max_waiting_tokens", self.max_waiting_tokens),
        ):
            for band, value in table.items():
                if value is not None and value < 0:
                    raise ValueError(f"queue.{name}.{band} must not be negative")
        return self

    def wait_for(self, priority: Priority) -> float:
        """The longest a request of `priority` may wait (0: decide now)."""
        for band, wait in self.max_wait_s.items():
            if band == priority.label:
                return float(wait)
        return 0.0

    @staticmethod
    def cap(table: dict[BandName, int | None], band: str) -> int | None:
        """A cap of `max_waiting` or `max_waiting_tokens` (None: uncapped)."""
        for name, cap in table.items():
            if name == band:
                return cap
        return None
