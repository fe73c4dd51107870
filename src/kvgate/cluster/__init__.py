"""Gateway replicas that admit as one, through a shared store.

- `sync`: the sync task (one store round trip per tick, membership, isolation) and
  `ClusterParticipant`, the core's side of it;
- `replica`: how a gateway becomes one replica (`join`);
- `publication`: the blob a replica publishes each tick (its core view, first-hand engine
  records, facts for operators);
- `samples`: engine samples shared between replicas, and the store's clock (`ClockLink`)
  that carries their times across;
- `shards`: which replica polls which engine (rendezvous hashing);
- `store`: the store's interface and the in-process `MemoryStore`; `redis_store` and `lua`:
  the Redis one;
- `settings`, `urls`: the one setting (`store.url`), and which store URLs are accepted and
  how they are shown;
- `telemetry`: the sync's figures for Prometheus.
"""
