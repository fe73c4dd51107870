"""The overload benchmark in virtual time on `cpu-tiny` slowed down by a factor.

`cpu-tiny` is fitted to the real vLLM CPU engine on a *quiet* machine (3-4 ms per token).
In the real-engine overload runs the same engine, sharing 2 cores with the load generator,
the gateway and other work, took 15-23 ms per token. This registers a preset `cpu-slow`
whose step latency is `cpu-tiny`'s times FACTOR (same KV cache, same scheduler limits) and
a benchmark profile for it identical to `cpu-tiny`'s, then runs `kvgate bench virtual` with
the remaining arguments. `OVERRIDES='{"high_watermark": 0.75}'` sets admission settings of the
`adaptive` runs (it is a settings override, not a code change).

    python benchmarks/long_request_fairness/slow_engine.py 4 --nodes 1 --loads 3 \\
        --policies direct,adaptive --duration 60 --seeds 1,2,3 --capacity-scale 0.8 --out DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from kvgate.bench import profiles, virtual
from kvgate.bench.suite import RunSpec
from kvgate.sim import presets
from kvgate.sim.model.engine import StepLatency
from kvgate.sim.runs import VirtualConfig


def register(factor: float) -> None:
    """Add the `cpu-slow` preset and profile: `cpu-tiny` with every latency term x factor."""
    lat = presets.CPU_TINY.latency
    slow = StepLatency(
        fixed_s=lat.fixed_s * factor,
        per_prefill_token_s=lat.per_prefill_token_s * factor,
        per_seq_s=lat.per_seq_s * factor,
        per_context_token_s=lat.per_context_token_s * factor,
    )
    presets.PRESETS["cpu-slow"] = dataclasses.replace(presets.CPU_TINY, latency=slow)
    profiles.PROFILES["cpu-slow"] = lambda: dataclasses.replace(
        profiles._cpu_tiny(), preset="cpu-slow"
    )


def with_overrides(overrides: dict[str, object]) -> None:
    """Apply admission-setting overrides to every `adaptive` run."""
    plain = virtual.virtual_config

    def config(spec: RunSpec) -> VirtualConfig:
        if spec.policy == "adaptive" and overrides:
            merged = {**spec.policy_overrides, **overrides}
            spec = dataclasses.replace(spec, policy_overrides=merged)
        return plain(spec)

    virtual.virtual_config = config  # type: ignore[assignment]


def main() -> int:
    register(float(sys.argv[1]))
    with_overrides(json.loads(os.environ.get("OVERRIDES", "{}")))
    from kvgate.cli import main as kvgate

    return kvgate(["bench", "virtual", "--preset", "cpu-slow", *sys.argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
