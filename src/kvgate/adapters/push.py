"""Samples pushed by sidecars (`POST /admin/signals`), validated into `NodeSample`s.

Canonical body (snake_case, seconds)::

    {"node": "gpu-a:8000", "kv_usage": 0.42, "kv_capacity_tokens": 65536,
     "running": 12, "waiting": 3, "iteration_latency_s": 0.021, "preemptions_total": 7}

The seed sketch's Go struct names are accepted too, so its sidecars can push unchanged:
`NodeID`, `KVCacheUsage`, `WaitingRequests`, `IterationLatencyMs` (milliseconds). A body
may also be a JSON list of such objects. The route (and its token check) lives in the
proxy; this module only validates: anything wrong raises `PushValidationError` naming the
offending field, ready for an OpenAI-style 400.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvgate.core.signals import NodeSample

MAX_PUSH_BYTES = 1024 * 1024
MAX_SAMPLES_PER_PUSH = 1000


class PushValidationError(ValueError):
    """A pushed body that is not a valid sample. `param` names the first bad field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PushedSample(BaseModel):
    """One sidecar report about one node."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    node: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[^\s]+$",
        validation_alias=AliasChoices("node", "node_id", "NodeID"),
    )
    kv_usage: float | None = Field(
        None, ge=0, le=1, validation_alias=AliasChoices("kv_usage", "KVCacheUsage")
    )
    kv_capacity_tokens: int | None = Field(None, gt=0, le=10**12)
    running: int = Field(0, ge=0, le=10**9, validation_alias=AliasChoices("running"))
    waiting: int = Field(
        0, ge=0, le=10**9, validation_alias=AliasChoices("waiting", "WaitingRequests")
    )
    iteration_latency_s: float | None = Field(None, ge=0, le=3600)
    iteration_latency_ms: float | None = Field(
        None,
        ge=0,
        le=3_600_000,
        validation_alias=AliasChoices("iteration_latency_ms", "IterationLatencyMs"),
    )
    preemptions_total: float | None = Field(None, ge=0)
    LastReportTime: Any = Field(None, exclude=True)  # sent by the sketch; our clock decides

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any) -> Any:
        """JSON true/false is not a count or a usage (pydantic would read true as 1)."""
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        return value

    @model_validator(mode="after")
    def _one_latency_unit(self) -> PushedSample:
        if self.iteration_latency_s is not None and self.iteration_latency_ms is not None:
            raise ValueError("give iteration_latency_s or iteration_latency_ms, not both")
        return self

    def to_sample(self, now: float) -> NodeSample:
        latency = self.iteration_latency_s
        if latency is None and self.iteration_latency_ms is not None:
            latency = self.iteration_latency_ms / 1000.0
        return NodeSample(
            kv_usage=self.kv_usage,
            kv_capacity_tokens=self.kv_capacity_tokens,
            running=self.running,
            waiting=self.waiting,
            iteration_latency_s=latency,
            sampled_at=now,
            preemptions_total=self.preemptions_total,
        )


def parse_push(body: bytes | str, now: float) -> list[tuple[str, NodeSample]]:
    """Validate a push body (one object or a list) into `(node_id, sample)` pairs."""
    raw = body.encode() if isinstance(body, str) else body
    if len(raw) > MAX_PUSH_BYTES:
        raise PushValidationError(f"body larger than {MAX_PUSH_BYTES} bytes")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PushValidationError(f"body is not JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise PushValidationError("empty list: nothing to observe")
    if len(items) > MAX_SAMPLES_PER_PUSH:
        raise PushValidationError(f"more than {MAX_SAMPLES_PER_PUSH} samples in one push")
    out: list[tuple[str, NodeSample]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise PushValidationError(f"sample {index} must be a JSON object", f"[{index}]")
        try:
            pushed = PushedSample.model_validate(item)
        except ValidationError as exc:
            raise _explain(exc, index if isinstance(data, list) else None) from None
        out.append((pushed.node, pushed.to_sample(now)))
    return out


def _explain(exc: ValidationError, index: int | None) -> PushValidationError:
    first = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    param = f"[{index}].{loc}" if index is not None else (loc or None)
    where = f" (sample {index})" if index is not None else ""
    return PushValidationError(f"invalid {loc or 'body'}{where}: {first.get('msg')}", param)
