"""The `cpu-tiny` model alone (no HTTP, no sleeping) on calibrate.py's workloads.

    python benchmarks/sim_calibration/model_only.py

Deterministic and independent of machine load: what the live simulator produces when it
keeps up, to set against the real engine's figures measured on a quiet machine
(scripts/real-vllm/README.md).
"""

from __future__ import annotations

from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY

WORKLOADS = {
    "single stream (100 in, 500 out)": (1, 100, 500),
    "light: 4 streams (200 in, 200 out)": (4, 200, 200),
    "32 streams (16 in, 80 out; fits the KV)": (32, 16, 80),
    "32 streams (50 in, 300 out; overflows the KV)": (32, 50, 300),
    "overload: 16 x (500 in, 1000 out)": (16, 500, 1000),
}


def main() -> None:
    print("| workload | throughput | TTFT median | TTFT max | preemptions | running max | "
          "waiting max | recomputed tokens |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (n, prompt, max_tokens) in WORKLOADS.items():
        engine = Engine(CPU_TINY, seed=0)
        for i in range(n):
            engine.add_request(f"r{i}", prompt, max_tokens, 0.0, ignore_eos=True)
        now, ttfts, running, waiting = 0.0, [], 0, 0
        while engine.has_work:
            result = engine.step(now)
            assert result is not None
            now = result.end
            ttfts += [now] * len(result.first_tokens)
            running = max(running, engine.num_running)
            waiting = max(waiting, engine.num_waiting)
        ttfts.sort()
        snap = engine.metrics_snapshot()
        print(
            f"| {name} | {snap.generation_tokens_total / now:.0f} tok/s | "
            f"{ttfts[len(ttfts) // 2]:.2f} s | {ttfts[-1]:.2f} s | {snap.preemptions_total} | "
            f"{running} | {waiting} | {snap.recomputed_tokens_total} |"
        )


if __name__ == "__main__":
    main()
