"""Prefix caching as the engines do it, for counting shared blocks once and routing by cache.

- `blocks`: the chained hash of each full `block_size`-token block of a prompt's token ids,
  the one key every part of kvgate (and the simulated engines) names a cached block by;
- `events`: the KV events an engine publishes about its cache (vLLM's `BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`, in batches), as plain records;
- `held`: the blocks the running requests on each node hold, each counted once, and who
  inherits a shared block when its owner ends;
- `index`: which blocks each engine has cached (an LRU per engine), for routing;
- `tracker`: an engine's KV events applied to the index, with the map from the engine's
  block keys to kvgate's and the clearing after lost events.
"""
