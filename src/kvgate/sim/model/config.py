"""What defines one simulated engine: its KV cache, its scheduler's limits, its model's
length limit and EOS behaviour, and the roofline model of its step latency (`presets` holds
named ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class StepLatency:
    """Roofline step-time model; every term is in seconds."""

    fixed_s: float
    per_prefill_token_s: float
    per_seq_s: float
    per_context_token_s: float

    def duration(self, prefill_tokens: int, seqs: int, context_tokens: int) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_seq_s * seqs
            + self.per_context_token_s * context_tokens
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that defines one engine. `num_blocks` counts vLLM's null block too;
    `enable_prefix_caching` caches full blocks across requests (`kvgate.sim.model.prefix`)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    latency: StepLatency
    enable_chunked_prefill: bool = True
    scheduling: Literal["fcfs", "priority"] = "fcfs"
    abort_on_disconnect: bool = True
    eos_mean_tokens: float = 256.0
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size < 1:
            raise ValueError("num_blocks must be >= 2 and block_size >= 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("need 1 <= max_num_seqs <= max_num_batched_tokens")
        if self.latency.fixed_s <= 0:
            raise ValueError("a step must take some time: latency.fixed_s must be > 0")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.eos_mean_tokens < 1:
            raise ValueError("eos_mean_tokens must be >= 1")
        if self.max_model_len > self.usable_blocks * self.block_size:
            # vLLM refuses to start in this case too: one full-length sequence must fit.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the KV cache's usable capacity "
                f"({self.usable_blocks * self.block_size} tokens): lower max_model_len or "
                "add blocks"
            )

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """What a gateway computes from `cache_config_info`: num_gpu_blocks x block_size."""
        return self.num_blocks * self.block_size
