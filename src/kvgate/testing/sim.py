"""Simulated engines in a known state, for tests and benchmarks of what they export."""

from __future__ import annotations

from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY


def overloaded_engine() -> Engine:
    """The tiny CPU engine after 1,500 steps of 16 requests of 500 prompt tokens that each
    want 1,000 more: its KV cache is full and it has preempted, so every metric family it
    exports (gauges, counters and histograms) holds values that moved."""
    engine = Engine(CPU_TINY, seed=0)
    for i in range(16):
        engine.add_request(f"r{i}", 500, 1000, 0.0, ignore_eos=True)
    now = 0.0
    for _ in range(1500):
        result = engine.step(now)
        assert result is not None  # 16 requests of 1,000 tokens outlast 1,500 steps
        now = result.end
    return engine
