"""The cluster's Prometheus metrics, read from the sync task when `/metrics` is scraped.

- `kvgate_replicas`: live replicas in the last good sync (this one included);
- `kvgate_store_up`: 1 while this replica syncs with the store, 0 while it is isolated;
- `kvgate_store_sync_seconds`: round trip of each sync exchange (histogram);
- `kvgate_store_sync_failures_total`, `kvgate_store_isolations_total`: failed exchanges,
  and times this replica fell back to its isolated share;
- `kvgate_store_view_bytes`: size of the view this replica publishes each tick;
- `kvgate_replica_engines{role="scraped"|"shared"}`: engines this replica polls itself,
  and engines whose samples it takes from the replica that owns them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.cluster.sync import ClusterSync

# A sync over loopback takes ~0.3 ms; the tick gives up at 150 ms.
_SYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15)


class ClusterCollector(Collector):
    def __init__(self, sync: ClusterSync) -> None:
        self._sync = sync
        self._latency = Histogram(
            "kvgate_store_sync_seconds",
            "Round trip of each exchange with the cluster store.",
            buckets=_SYNC_BUCKETS,
            registry=None,
        )

    def collect(self) -> Iterator[Metric]:
        sync = self._sync
        stats = sync.stats
        for latency in stats.drain_latencies():
            self._latency.observe(latency)
        yield from self._latency.collect()
        yield GaugeMetricFamily(
            "kvgate_replicas",
            "Live gateway replicas in the last good sync, this one included.",
            value=len(sync.members) or 1,
        )
        yield GaugeMetricFamily(
            "kvgate_store_up",
            "1 while this replica syncs with the cluster store, 0 while isolated.",
            value=1.0 if sync.state == "synced" else 0.0,
        )
        yield CounterMetricFamily(
            "kvgate_store_sync_failures",
            "Sync exchanges that failed or timed out.",
            value=stats.failures_total,
        )
        yield CounterMetricFamily(
            "kvgate_store_isolations",
            "Times this replica fell back to its isolated share of each node.",
            value=stats.isolations_total,
        )
        yield GaugeMetricFamily(
            "kvgate_store_view_bytes",
            "Size of the view this replica publishes each tick.",
            value=stats.view_bytes,
        )
        engines = GaugeMetricFamily(
            "kvgate_replica_engines",
            "Engines this replica polls itself (scraped), or learns from their owner (shared).",
            labels=["role"],
        )
        served = sync.served_nodes()
        shared = sum(1 for node_id in served if not sync.scrapes(node_id))
        engines.add_metric(["scraped"], len(served) - shared)
        engines.add_metric(["shared"], shared)
        yield engines
