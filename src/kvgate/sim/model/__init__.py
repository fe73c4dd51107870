"""The engine model: a pure, step-by-step model of a paged-KV, continuous-batching engine
(vLLM v1's scheduler), driven by the live simulator (`kvgate.sim.server`) and the
virtual-time runner (`kvgate.sim.virtual`) alike.

- `engine`: `Engine`, one engine, and what driving it returns;
- `config`: `EngineConfig` and its step-latency roofline;
- `scheduler`: vLLM's `schedule()`, preemption and the KV block pool;
- `prefix`: the pool's prefix cache (cached free blocks evicted LRU, hit counters, KV
  events) and the ids of the output tokens;
- `sequences`: one request inside the engine and the waiting queue;
- `decoding`: the decoding sequences, kept in aggregate;
- `histogram`: Prometheus-style histograms and vLLM's bucket bounds.
"""
