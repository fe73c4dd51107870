"""Per-preset scenario parameters: the mix at 1x, the SLO and the client timeout.

The numbers are chosen from the engine's size and speed, before any policy was run, and
are the same for every policy. The 1x rates here are only a starting guess: the benchmark
measures the sustainable capacity with `direct` and rescales (see `kvgate.bench.suite`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.bench.metrics import Slo
from kvgate.bench.workload import Shape
from kvgate.sim.runs import ClientModel


@dataclass(frozen=True)
class Variant:
    """One configuration compared: the admission policy and how the gateway around it runs.

    `queue`: requests that cannot start wait in the gateway (kvgate's default) instead of
    being refused at once; `order`: `fair` (priority bands, tenant fairness, backfill that
    never delays the head) or `fcfs` (strict arrival order: nothing passes a waiting
    request); `feedback`: the adaptive policy's margin on measured usage; `cancel`: client
    disconnects reach the engine.
    """

    policy: str
    cancel: bool = True
    queue: bool = True
    order: str = "fair"
    feedback: bool = True


POLICIES: dict[str, Variant] = {
    "direct": Variant("none"),
    "static-qps": Variant("static-qps"),
    "static-concurrency": Variant("static-concurrency"),
    "seed": Variant("seed"),
    "adaptive": Variant("adaptive"),
    "adaptive-fixed": Variant("adaptive-fixed"),
    "adaptive-fcfs": Variant("adaptive", order="fcfs"),
    "adaptive-noqueue": Variant("adaptive", queue=False),
    "adaptive-nofeedback": Variant("adaptive", feedback=False),
    "adaptive-nocancel": Variant("adaptive", cancel=False),
}
# What `--policies all` runs: the baselines and kvgate with and without its queue.
DEFAULT_POLICIES = ("direct", "static-qps", "static-concurrency", "seed", "adaptive",
                    "adaptive-noqueue", "adaptive-nocancel")  # fmt: skip


@dataclass(frozen=True)
class Profile:
    """Everything preset-specific about the scenario."""

    preset: str
    shape: Shape
    slo: Slo
    client: ClientModel
    why: str


def _gpu_8b() -> Profile:
    # 23,000 blocks x 16 = 368k tokens per node; max_model_len 131,072 caps a long prompt at
    # 35% of the KV (the issue asks 25-50%; 50% would not fit the model's context).
    kv = 23_000 * 16
    shape = Shape(
        kv_capacity_tokens=kv,
        chat_rate=4.0,
        long_rate=0.04,
        burst_every_s=60.0,
        burst_per_node=1.0,
        long_prompt_frac=(0.25, 0.35),
        first_burst_s=30.0,
    )
    return Profile(
        preset="gpu-8b",
        shape=shape,
        # A 92-129k-token prefill takes ~4-5 s alone at 8,192 tokens per ~0.33 s step.
        slo=Slo(ttft_s=2.0, tpot_s=0.2, long_ttft_s=15.0),
        client=ClientModel(timeout_s=30.0),
        why="Llama-3.1-8B on one H100: 368k KV tokens per node; long prompts 25-35% of it",
    )


def _cpu_tiny() -> Profile:
    # 128 blocks x 32 = 4,096 tokens per engine; max_model_len 2,048 caps a long prompt at
    # 40% (1,638 tokens) so that prompt + 400 output tokens fits.
    kv = 128 * 32
    shape = Shape(
        kv_capacity_tokens=kv,
        chat_rate=1.5,
        long_rate=0.1,
        burst_every_s=20.0,
        burst_per_node=3.0,
        long_prompt_frac=(0.25, 0.40),
        first_burst_s=10.0,
    )
    return Profile(
        preset="cpu-tiny",
        shape=shape,
        slo=Slo(ttft_s=1.0, tpot_s=0.05, long_ttft_s=3.0),
        # Timeout scaled down with the engine: a long request takes ~1-2 s when healthy.
        client=ClientModel(timeout_s=10.0),
        why="the real vLLM CPU engine's 4,096-token KV; long prompts 25-40% of it",
    )


PROFILES = {"gpu-8b": _gpu_8b, "cpu-tiny": _cpu_tiny}


def get_profile(preset: str) -> Profile:
    try:
        return PROFILES[preset]()
    except KeyError:
        raise KeyError(f"no benchmark profile for preset {preset!r}") from None
