"""Admission settings: which policy, its watermarks and its knobs (validated by pydantic).

Every field's `description` ends up in the README's configuration reference
(`kvgate config-doc`), so keep them short and exact.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PolicyName = Literal["none", "static-qps", "static-concurrency", "seed", "adaptive"]
FailMode = Literal["closed", "open"]


class AdmissionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName = Field("adaptive", description="Admission policy; `adaptive` is kvgate's.")
    high_watermark: float = Field(
        0.80, gt=0, lt=1, description="Predicted KV usage where backpressure starts."
    )
    panic_watermark: float = Field(
        0.92,
        gt=0,
        le=1,
        description="Predicted KV usage where all new work is shed, critical included.",
    )
    stale_after_s: float = Field(
        1.0, gt=0, description="A node whose last good sample is older takes no new requests."
    )
    default_max_tokens: int = Field(
        1024, gt=0, description="Output cap assumed when a request sends no `max_tokens`."
    )
    retry_after_max_s: float = Field(30.0, ge=1, description="Upper clamp of Retry-After.")
    seed: int | None = Field(None, description="PRNG seed for shedding and jitter (None: random).")
    static_qps: float = Field(50.0, gt=0, description="Token-bucket rate for `static-qps`.")
    static_burst: int = Field(50, gt=0, description="Token-bucket depth for `static-qps`.")
    static_concurrency: int = Field(
        32, gt=0, description="In-flight request cap for `static-concurrency`."
    )

    # --- freshness and fail mode -------------------------------------------------------
    fail_mode: FailMode = Field(
        "closed",
        description=(
            "When no candidate node is fresh: `closed` answers 503 + Retry-After and never sends"
            " to nodes nobody has heard from; `open` sends to the candidate heard from most"
            " recently (never-observed nodes only if none was ever observed), without KV checks."
        ),
    )
    failures_to_stale: int = Field(
        10,
        ge=1,
        description="Hard scrape failures in a row (refused, HTTP error, unparseable page)"
        " after which a node is dead before `stale_after_s`; a slow page is not a failure.",
    )

    # --- reservations --------------------------------------------------------------------
    reflect_margin_s: float = Field(
        0.1,
        ge=0,
        description=(
            "A sample is trusted to contain a request's prompt only if it was taken this long"
            " after the request's first token (covers engine gauge lag and scrape latency)."
        ),
    )
    reservation_overhead_tokens: int = Field(
        16,
        ge=0,
        description="Extra tokens reserved per request (KV block rounding).",
    )
    default_capacity_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "KV capacity assumed for engines that report none (llama.cpp, TGI); without it such"
            " nodes are gated by their queue signals only."
        ),
    )

    # --- control (adaptive) -----------------------------------------------------------------
    standard_ceiling: float | None = Field(
        None,
        gt=0,
        le=1,
        description=(
            "Predicted usage a `standard` request may never push a node past"
            " (default: midway between the high and panic watermarks)."
        ),
    )
    hysteresis: float = Field(
        0.03,
        ge=0,
        lt=0.5,
        description="A node leaves the high/panic state only this far below the watermark.",
    )
    controller: Literal["pid", "gradient"] = Field(
        "pid",
        description=(
            "Limit algorithm of `adaptive` between the watermarks: `pid` (default) or"
            " `gradient` (Netflix Gradient2 on KV usage, for comparison)."
        ),
    )
    controller_kp: float = Field(
        0.25, ge=0, description="PID proportional gain (shed pressure per unit of error)."
    )
    controller_ki: float = Field(
        2.0, ge=0, description="PID integral gain (shed pressure per unit of error per second)."
    )
    controller_kd: float = Field(
        0.01, ge=0, description="PID derivative gain, applied to the measurement (seconds)."
    )
    control_interval_s: float = Field(
        0.04,
        gt=0,
        description="Each node's feedback controller runs at most this often (on its samples).",
    )
    thrash_latency_factor: float = Field(
        4.0,
        gt=1,
        description="Iteration latency this many times its healthy baseline means thrashing.",
    )
    latency_baseline_halflife_s: float = Field(
        30.0, gt=0, description="Half-life of the slow EWMA that learns healthy iteration latency."
    )
    thrash_hold_s: float = Field(
        2.0, ge=0, description="A thrashing node stays out of rotation at least this long."
    )
    release_rate_halflife_s: float = Field(
        5.0,
        gt=0,
        description="Half-life of the EWMA of freed tokens per second (drives Retry-After).",
    )
    large_request_fraction: float = Field(
        0.1,
        gt=0,
        le=1,
        description=(
            "`adaptive`: a request needing at least this fraction of a node's KV is *large*:"
            " its refusals get spread Retry-Afters and (with `claims`) leave claims."
        ),
    )
    large_retry_spread: bool = Field(
        True,
        description=(
            "`adaptive`: refused large requests get Retry-Afters spread over the time their"
            " backlog takes to drain, so a burst of them does not retry in lock-step."
        ),
    )
    claims: bool = Field(
        False,
        description=(
            "`adaptive`: a large request refused for lack of room leaves a time-limited claim"
            " on the node closest to fitting it; smaller requests must leave that room free,"
            " so freed KV accumulates for the large request instead of being taken by chats."
        ),
    )
    claim_use_fraction: float = Field(
        0.8,
        gt=0,
        le=1,
        description="A request at least this fraction of a claim's size may use (and ends) it.",
    )
    claim_lead_s: float = Field(
        0.5,
        ge=0,
        description=(
            "A claim binds smaller requests only from this long before its request is due"
            " back (its Retry-After); until then short requests, done by then, may use the room."
        ),
    )
    claim_grace_s: float = Field(
        1.0,
        ge=0,
        description="A claim expires this long after the Retry-After given to its request.",
    )
    p2c_min_nodes: int = Field(
        8, ge=2, description="From this many candidates on, route by power of two choices."
    )

    # --- cost estimation ----------------------------------------------------------------------
    chars_per_token: float = Field(
        4.0, gt=0, description="Initial chars-per-token ratio of the prompt estimator."
    )
    chars_per_token_min: float = Field(
        1.0, gt=0, description="Lower clamp of the learned chars-per-token ratio."
    )
    chars_per_token_max: float = Field(
        8.0, gt=0, description="Upper clamp of the learned chars-per-token ratio."
    )
    prompt_safety_factor: float = Field(
        1.1,
        ge=1,
        description="Estimated prompt tokens are multiplied by this (under-counting is unsafe).",
    )
    tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="Model name -> tokenizer.json path, for exact prompt token counts.",
    )

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> AdmissionSettings:
        if self.panic_watermark <= self.high_watermark:
            raise ValueError("panic_watermark must be above high_watermark")
        ceiling = self.standard_ceiling
        if ceiling is not None and not self.high_watermark <= ceiling <= self.panic_watermark:
            raise ValueError("standard_ceiling must lie between the high and panic watermarks")
        if self.chars_per_token_min > self.chars_per_token_max:
            raise ValueError("chars_per_token_min must not exceed chars_per_token_max")
        return self

    @property
    def standard_ceiling_value(self) -> float:
        """The effective ceiling for `standard` requests."""
        if self.standard_ceiling is not None:
            return self.standard_ceiling
        return (self.high_watermark + self.panic_watermark) / 2
