"""Which engines kvgate fronts and how it watches them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EngineKind = Literal["vllm", "sglang", "trtllm", "triton", "tgi", "llamacpp"]


class BackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the engine's OpenAI-compatible server.")
    engine: EngineKind = Field("vllm", description="Engine dialect (metrics and abort API).")
    name: str | None = Field(None, description="Node id in metrics and logs (default: host:port).")
    metrics_url: str | None = Field(None, description="Metrics page (default: URL + /metrics).")
    api_key: str | None = Field(
        None, description="Bearer token sent upstream (never logged, never a client key)."
    )
    kv_capacity_tokens: int | None = Field(
        None,
        gt=0,
        description=(
            "KV capacity in tokens, for engines whose metrics do not say "
            "(TGI: --max-batch-total-tokens; llama.cpp: --ctx-size). Ignored when the page has it."
        ),
    )


class ScrapeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(
        0.05, ge=0.02, le=1.0, description="Scrape period of each engine's metrics page."
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Scrape timeout (default: 80% of the interval)."
    )
    narrow_pages: bool = Field(
        True,
        description=(
            "Ask engines that support it (vLLM) for only the metrics kvgate reads "
            "(`/metrics/?name[]=...`), once a check shows that page carries all of them: "
            "~2 KB instead of ~50 KB, and ~1/6 of the engine's CPU per scrape."
        ),
    )
    http_client: Literal["lean", "aiohttp"] = Field(
        "lean",
        description=(
            "HTTP client for scrapes: `lean` (kvgate's keep-alive HTTP/1.1 GET, about half "
            "aiohttp's CPU per scrape) or `aiohttp` (honours HTTP(S)_PROXY, compressed pages)."
        ),
    )
