"""Routing: which of the nodes a request fits on it goes to (a part of `AdaptivePolicy`).

The policy decides *whether* a request fits on a node (its envelope under its ceiling);
a `Routing` ranks the nodes it fits on. One small interface, two implementations, chosen
by name (`ROUTING_NAMES`) so that the benchmarks compare them on the same policy:

- `headroom` (`HeadroomRouting`): the node whose engine has the least prefill queued
  (prompts sent there that have not produced a first token, less what the node's running
  requests or, as the index predicts, its cache hold), then the most headroom left;
- `prefix` (`PrefixRouting`, the default): the node where the request waits for the least
  prefill, counting what the node has cached of its prompt (`kvgate.core.prefix.index`):
  a node that holds the prompt's first 1,536 of 2,048 tokens prefills 512. In tokens:

      score(n) = backlog(n) + (prompt - cached(n)) + (1 - headroom(n)) * prompt

  The last term keeps a hot prefix from piling on one engine: a node with a fraction `h`
  of the prompt cached wins over an empty node until the planned peak fills a fraction `h`
  of what it may hold; past that (or once its prefill backlog grows) the prompt goes
  elsewhere and that node caches it too. A node the request does not fit on is never
  ranked (the policy filters first), so a cache never overrides a ceiling.

A route is asked for once per decision (`query`); besides ranking, a prefix route names
the nodes worth checking beyond the policy's two random choices (`extra`: the engines
holding the longest cached prefix of the prompt, found without a scan), and `placed` tells
the routing where the request went (the approximate index learns from it) and returns why,
for the access log: `prefix 1536/2048` (cached tokens / prompt tokens) or `headroom`.
"""

from __future__ import annotations

from itertools import islice
from typing import Literal, Protocol, get_args

from kvgate.core.prefix.events import BlockStored, KVEventBatch
from kvgate.core.prefix.held import PromptBlocks, reusable
from kvgate.core.prefix.index import DEFAULT_BLOCK_SIZE, PrefixIndex
from kvgate.core.prefix.tracker import EventTracker
from kvgate.core.request import AdmissionRequest

RoutingName = Literal["prefix", "headroom"]
#: The routings a policy may be built with, the default first.
ROUTING_NAMES: tuple[RoutingName, ...] = get_args(RoutingName)
#: Engines holding a prompt's longest cached prefix checked beyond the two random choices.
MAX_EXTRA = 4
#: Weight of a node's fullness against the prefill it saves (the score's last term).
BALANCE = 1.0


class Route(Protocol):
    """One request's ranking of the nodes it fits on (lower scores first)."""

    def extra(self, a: str, b: str) -> tuple[str, ...]:
        """Nodes to check beside two random picks `a` and `b`: those caching the prompt
        deepest, unless a pick caches it as deep (then they add checks, not cache)."""
        ...

    def score(self, node_id: str, backlog: int, headroom: float) -> tuple[float, float]: ...

    def cached(self, node_id: str) -> int:
        """Prompt tokens the node's engine is expected to have cached."""
        ...


class Routing(Protocol):
    """Ranks the nodes a request fits on; learns where requests went."""

    name: str

    def query(self, request: AdmissionRequest) -> Route: ...

    def placed(self, node_id: str, request: AdmissionRequest) -> str:
        """The request went to `node_id`; returns why (for the access log)."""
        ...

    def capacity(self, node_id: str, tokens: int) -> None:
        """The node's KV capacity in tokens (sizes its cache model)."""
        ...

    def forget(self, node_id: str) -> None: ...

    def node_snapshot(self, node_id: str) -> dict[str, float | int | None]:
        """What `/admin/state` and the metrics show of the node's routing."""
        ...


class _HeadroomRoute:
    __slots__ = ()

    def extra(self, a: str, b: str) -> tuple[str, ...]:
        return ()

    def score(self, node_id: str, backlog: int, headroom: float) -> tuple[float, float]:
        return (backlog, -headroom)

    def cached(self, node_id: str) -> int:
        return 0


_HEADROOM_ROUTE = _HeadroomRoute()


class HeadroomRouting:
    """Least prefill queued, then most headroom: blind to the engines' caches."""

    name = "headroom"

    def query(self, request: AdmissionRequest) -> Route:
        return _HEADROOM_ROUTE

    def placed(self, node_id: str, request: AdmissionRequest) -> str:
        return "headroom"

    def capacity(self, node_id: str, tokens: int) -> None:
        pass

    def forget(self, node_id: str) -> None:
        pass

    def node_snapshot(self, node_id: str) -> dict[str, float | int | None]:
        return {}


class PrefixRoute:
    """A prompt's cached prefix on each node, looked up as the policy asks."""

    __slots__ = ("_blocks", "_cached", "_deepest", "_index", "_sizes", "prompt", "request")

    def __init__(self, routing: PrefixRouting, request: AdmissionRequest) -> None:
        self.request = request
        self.prompt = request.cost.prompt_tokens
        self._index = routing.index
        self._sizes = routing.block_sizes
        self._blocks = routing.blocks
        self._cached: dict[str, int] = {}
        self._deepest: tuple[str, ...] = ()
        ids = request.prompt_ids
        if ids and not self._index.empty:  # an empty index holds no prefix: nothing hashed
            hashes = self.hashes(DEFAULT_BLOCK_SIZE)
            depth, holders = self._index.deepest(hashes)
            if depth:  # the first MAX_EXTRA among the candidates: a hot prefix is everywhere
                serving = (n for n in holders if n in request.candidates)
                self._deepest = tuple(islice(serving, MAX_EXTRA))

    def extra(self, a: str, b: str) -> tuple[str, ...]:
        deepest = self._deepest
        if not deepest or max(self.cached(a), self.cached(b)) >= self.cached(deepest[0]):
            return ()
        return tuple(x for x in deepest if x != a and x != b)

    def hashes(self, block_size: int) -> list[int]:
        """The prompt's block hashes at `block_size` (`PromptBlocks.of`)."""
        return self._blocks.of(self.request.prompt_ids or (), block_size)

    def cached(self, node_id: str) -> int:
        """Prompt tokens the node has cached (never the block of the last token, which an
        engine computes again)."""
        got = self._cached.get(node_id)
        if got is None:
            ids = self.request.prompt_ids
            if not ids or not self._index.blocks(node_id):
                got = 0
            else:
                size = self._sizes.get(node_id, DEFAULT_BLOCK_SIZE)
                most = reusable(len(ids), size)
                got = min(most, self._index.matched(node_id, self.hashes(size))) * size
            self._cached[node_id] = got
        return got

    def score(self, node_id: str, backlog: int, headroom: float) -> tuple[float, float]:
        prompt = self.prompt
        cached = self.cached(node_id)
        return (backlog + prompt - cached + BALANCE * (1.0 - headroom) * prompt, -headroom)


class PrefixRouting:
    """Least prefill to wait for, counting each node's cached prefix (the module's score)."""

    name = "prefix"

    def __init__(self, block_sizes: dict[str, int], blocks: PromptBlocks) -> None:
        self.index = PrefixIndex()
        self.block_sizes = block_sizes  # the policy's: each node's engine block size
        self.blocks = blocks
        self.events = EventTracker(self.index)
        self._last: PrefixRoute | None = None
        # Per node: prompt tokens sent there and those the index predicted cached.
        self._queried: dict[str, int] = {}
        self._hits: dict[str, int] = {}

    def query(self, request: AdmissionRequest) -> Route:
        if not request.prompt_ids:
            return _HEADROOM_ROUTE  # nothing to look up: ranked as by headroom alone
        last = self._last
        if last is None or last.request is not request:
            last = self._last = PrefixRoute(self, request)
        return last

    def placed(self, node_id: str, request: AdmissionRequest) -> str:
        route = self.query(request)
        if not isinstance(route, PrefixRoute):
            return "headroom"
        self._last = None
        cached = route.cached(node_id)
        self._queried[node_id] = self._queried.get(node_id, 0) + route.prompt
        self._hits[node_id] = self._hits.get(node_id, 0) + cached
        size = self.block_sizes.get(node_id, DEFAULT_BLOCK_SIZE)
        self.index.store(node_id, route.hashes(size))
        return f"prefix {max(0, cached)}/{route.prompt}"

    def capacity(self, node_id: str, tokens: int) -> None:
        size = self.block_sizes.get(node_id, DEFAULT_BLOCK_SIZE)
        self.index.resize(node_id, tokens // size)

    def block_size(self, node_id: str, size: int) -> None:
        """The node's engine caches blocks of `size` tokens."""
        if size > 0 and self.block_sizes.get(node_id, DEFAULT_BLOCK_SIZE) != size:
            self.block_sizes[node_id] = size
            self.events.reset(node_id)

    def kv_events(self, node_id: str, batch: KVEventBatch) -> bool:
        """One batch of the node's KV events (`EventTracker.apply`); False: events were lost."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.block_size(node_id, event.block_size)
                break
        return self.events.apply(node_id, batch)

    def forget(self, node_id: str) -> None:
        self.index.forget(node_id)
        self.events.forget(node_id)
        self._queried.pop(node_id, None)
        self._hits.pop(node_id, None)

    def node_snapshot(self, node_id: str) -> dict[str, float | int | None]:
        queried = self._queried.get(node_id, 0)
        return {
            "prefix_hit_rate_predicted": self._hits.get(node_id, 0) / queried if queried else None,
            "prefix_index_blocks": self.index.blocks(node_id),
            "prefix_resyncs": self.events.resyncs.get(node_id, 0),
        }


def build_routing(name: RoutingName, block_sizes: dict[str, int], blocks: PromptBlocks) -> Routing:
    """The routing called `name` (one of `ROUTING_NAMES`), on the policy's block sizes and
    prompt hashes."""
    if name == "prefix":
        return PrefixRouting(block_sizes, blocks)
    if name == "headroom":
        return HeadroomRouting()
    raise ValueError(f"no routing is called {name!r}; choose from {', '.join(ROUTING_NAMES)}")
