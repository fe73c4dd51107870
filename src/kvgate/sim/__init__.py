"""An inference-engine simulator that behaves like vLLM where overload is decided.

- `engine`: the pure engine model (paged KV blocks, continuous batching in vLLM v1's order,
  chunked prefill, recompute preemption, prefix caching, aborts, zombies, roofline step
  latency), built of `config` (what defines an engine), `sequences` (a request inside it,
  the waiting queue), `scheduler` (vLLM's schedule() and the KV block pool), `prefix` (the
  pool's prefix cache and its KV events), `decoding` (the decoding sequences in aggregate)
  and `histogram` (its latency histograms).
- `presets`: `cpu-tiny` (calibrated to the real vLLM CPU build) and `gpu-8b` (Llama-3.1-8B
  on one H100-class GPU).
- `metrics`: the vLLM-named Prometheus page (plus `sim:` counters).
- `server` + `openai_request` + `cli`: live mode, `kvgate sim --nodes N`: OpenAI-compatible
  HTTP engines; `kv_publisher`: their KV events over ZMQ in vLLM's wire format
  (`--enable-prefix-caching --kv-events-config`).
- `workload` (Poisson arrivals) and `prefix_workloads` (prompts that share prefixes, as
  token ids: multi-turn chats, RAG, a system prompt per tenant, a hot prefix) + `virtual` +
  `runs`: virtual-time mode, a discrete-event cluster of engine
  models behind kvgate admission policies (`virtual`), for long and large experiments; a
  run's configuration and what it records (`runs`); how the engines' KV events reach the
  replicas (`kv_fanout`)::

      from kvgate.sim.presets import GPU_8B
      from kvgate.sim.runs import VirtualConfig
      from kvgate.sim.virtual import run_virtual
      from kvgate.sim.workload import WorkloadSpec

      result = run_virtual(VirtualConfig(
          engine=GPU_8B, workload=WorkloadSpec(rate_rps=300), duration_s=120, nodes=16,
          gateways=2, policy="adaptive", seed=1))
      print(result.summary())
"""
