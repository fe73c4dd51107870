"""The adaptive policy against simulated paged-KV engines at 3x their sustainable load.

Virtual time (`kvgate.sim.virtual`, via `kvgate.bench.virtual`): the engine simulator with
vLLM-style scheduling and recompute preemption, scraped every 50 ms with 10 ms delivery lag,
clients that time out, retry and honour Retry-After. The same seeded workload goes through
`none` and `adaptive` (with the gateway's queue, as `kvgate serve` runs it).
"""

from __future__ import annotations

import pytest

from kvgate.bench.metrics import summarize
from kvgate.bench.profiles import get_profile
from kvgate.bench.suite import RunSpec
from kvgate.bench.virtual import run_virtual


def _run(policy: str, seed: int) -> tuple[dict, float, float]:
    prof = get_profile("cpu-tiny")
    spec = RunSpec(
        preset="cpu-tiny",
        nodes=2,
        shape=prof.shape,
        load=3.0,
        seed=seed,
        duration_s=30.0,
        warmup_s=5.0,
        client=prof.client,
        slo=prof.slo,
        label=policy,
        policy=policy,
    )
    result = run_virtual(spec)
    return summarize(result), max(result.series["kv_usage_max"]), max(result.series["queued"])


@pytest.mark.parametrize("seed", [4, 5])
def test_adaptive_prevents_the_preemption_that_no_admission_suffers(seed: int) -> None:
    unprotected, unprotected_peak, _ = _run("none", seed)
    protected, protected_peak, most_queued = _run("adaptive", seed)
    assert unprotected["preemptions"] > 0 and unprotected_peak == 1.0
    assert protected["preemptions"] == 0
    assert protected_peak <= 0.92
    # The excess waited in the gateway instead of in the engines' KV caches.
    assert most_queued > 0 and protected["errors"] == 0
    assert protected["completed"] == protected["user_requests"]
    assert protected["slo_attainment"] > unprotected["slo_attainment"]
