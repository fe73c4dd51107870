"""Admission settings: which policy, its watermarks and its knobs (validated by pydantic)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PolicyName = Literal["none", "static-qps", "static-concurrency", "seed", "adaptive"]


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
