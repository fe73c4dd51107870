"""Named engine configurations: one calibrated against a real engine, one for a real GPU.

`cpu-tiny` mirrors the real vLLM CPU build of `scripts/real-vllm/` (a 2-layer random-weight
Llama served by `serve.sh`): 8 MiB of KV = 4,096 tokens = 128 blocks of 32, `max_num_seqs`
32, `max_model_len` 2048, and vLLM's CPU default `max_num_batched_tokens` of 2048
(`vllm/engine/arg_utils.py`, `current_platform.is_cpu()` branch, OpenAI server). Its step
latency was fitted to that engine's measured speed (one stream 3-4 ms per token, 32 streams
2.0-2.3k tokens/s in total) and then checked side by side on the same workloads; see
`benchmarks/sim_calibration/results.md` for how close it is.

`gpu-8b` models Llama-3.1-8B-Instruct in BF16 on one H100 SXM 80 GB with vLLM defaults:

- KV per token: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB
  (the model's published `config.json`). Memory for KV: 80 GB x 0.9
  (`gpu_memory_utilization` default) - 16 GB of weights - ~6 GB of activations and CUDA
  graphs ~= 50 GB, i.e. ~380k tokens; we use 23,000 blocks of 16 (vLLM's GPU default block
  size) = 368k tokens, inside the 200-400k range engines of this class report.
- `max_num_batched_tokens` 8192 and `max_num_seqs` 1024: vLLM's defaults for the OpenAI
  server on >= 70 GiB GPUs other than A100 (`vllm/engine/arg_utils.py`).
- Step latency: a decode step must stream the 16 GB of weights through HBM (3.35 TB/s on
  H100 SXM, NVIDIA's datasheet), ~4.8 ms at the limit, ~6.5 ms at the ~75 % of the
  roofline that vLLM reaches (a Llama-3.1-8B sweep on A100 measured 75 tok/s single-stream,
  77 % of its bandwidth ceiling: johnmusgrave.com/p/vllm-throughput-latency-sweep-on).
  Each context token attended reads 128 KiB of KV: ~55 ns at that efficiency. Prefill is
  compute-bound: 2 x 8e9 FLOPs per token at ~40 % of 989 TFLOPS ~= 40 us per token.
  Result: ~7 ms per token alone, ~20 ms per step at 64 sequences of 2k context and ~30 ms
  at 128, total decode throughput ~4-10k tokens/s, in line with published vLLM figures
  for this pairing (e.g. ~12.5k tok/s peak in morphllm.com/vllm-benchmarks; Azure's
  "Performance of Llama 3.1 8B AI Inference using vLLM on ND-H100-v5", 2025).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgate.sim.model.engine import EngineConfig, StepLatency

CPU_TINY = EngineConfig(
    num_blocks=128,
    block_size=32,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    max_model_len=2048,
    latency=StepLatency(
        fixed_s=2.9e-3,
        per_prefill_token_s=25e-6,
        per_seq_s=0.33e-3,
        per_context_token_s=0.15e-6,
    ),
)

GPU_8B = EngineConfig(
    num_blocks=23_000,
    block_size=16,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    max_model_len=131_072,
    latency=StepLatency(
        fixed_s=6.5e-3,
        per_prefill_token_s=40e-6,
        per_seq_s=25e-6,
        per_context_token_s=55e-9,
    ),
)

PRESETS: dict[str, EngineConfig] = {"cpu-tiny": CPU_TINY, "gpu-8b": GPU_8B}


def get_preset(name: str, **overrides: Any) -> EngineConfig:
    """A preset with some fields replaced (None values are ignored). Raises KeyError."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base, **changes) if changes else base
