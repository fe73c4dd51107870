"""Prefix caching as the engines do it, for counting shared blocks once and routing by cache.

- `blocks`: the chained hash of each full `block_size`-token block of a prompt's token ids,
  the one key every part of kvgate (and the simulated engines) names a cached block by;
- `events`: the KV events an engine publishes about its cache (vLLM's `BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`, in batches), as plain records.
"""
