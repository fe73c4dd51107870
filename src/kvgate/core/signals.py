"""What an engine tells us about itself, reduced to the few numbers admission needs
(`NodeSample`), and where those samples go (`SignalSink`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One scrape (or push) of one engine, already converted from its dialect.

    `kv_usage` is None for engines that export no KV gauge (llama.cpp); the controller
    then falls back on queue and latency signals and on its own reservations.
    `iteration_latency_s` is the mean inter-token latency *between this sample and the
    previous one* (delta of histogram sum / delta of count; on a node's first sample, and
    after its engine restarted, the mean of the whole histogram), None when no token was
    made; `iteration_tokens` the number of intervals that mean rests on (None: not said, it
    weighs as one).
    `sampled_at` is on the core's clock, not the engine's. `block_size` is the tokens per
    KV block the engine caches by (vLLM's `cache_config_info`), and `prefix_hits_total` /
    `prefix_queries_total` its prefix cache's counters (prompt tokens found cached / looked
    up), None where the engine does not say.
    """

    kv_usage: float | None
    kv_capacity_tokens: int | None
    running: int
    waiting: int
    iteration_latency_s: float | None
    sampled_at: float
    preemptions_total: float | None = None
    block_size: int | None = None
    prefix_hits_total: float | None = None
    prefix_queries_total: float | None = None
    iteration_tokens: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form, the one used by `/admin/state`, the dashboard and the cluster."""
        return {
            "kv_usage": self.kv_usage,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "running": self.running,
            "waiting": self.waiting,
            "iteration_latency_s": self.iteration_latency_s,
            "sampled_at": self.sampled_at,
            "preemptions_total": self.preemptions_total,
            "block_size": self.block_size,
            "prefix_hits_total": self.prefix_hits_total,
            "prefix_queries_total": self.prefix_queries_total,
            "iteration_tokens": self.iteration_tokens,
        }


class SignalSink(Protocol):
    """Where engine samples go: the admission core (its flow controller, or a policy), fed
    by the scraper (`kvgate.gateway.engines.scraper`) and by the samples other replicas
    share (`kvgate.cluster.samples`)."""

    def observe(self, node_id: str, sample: NodeSample) -> None: ...

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        """A failed scrape; not `hard` when it was only abandoned unanswered (a busy engine)."""
        ...
