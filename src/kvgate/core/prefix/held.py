"""Held blocks: the KV blocks the running requests on each node hold, each counted once.

An engine with prefix caching stores a block once however many running requests use it
(vLLM counts references; `kv_cache_usage_perc` counts the block once). So a request costs a
node only the blocks of its prompt that no request running there holds already, plus its
output. `HeldBlocks` keeps, per node, each held block's holders (ticket keys) and its
*owner*: the one hold whose prompt counts the block (`kvgate.core.plan.holds`). A newcomer
owns only the blocks it adds (`take` returns how many of its leading blocks were held) and
is counted as a sharer of the owners of the rest; the work per request is one dictionary
operation per block it owns and one step per owner it shares from, none per holder. A
hold's owned blocks are spans of positions in its prompt's chain, kept in order, so that
an owner passes on the leading ones, those its sharers hold.

A shared block frees when its last holder ends. When its owner ends first, the block
passes to the holder expected to end last (`drop` returns, per heir, how many blocks it
inherits, and the holds move those tokens from the owner's prompt to the heir's), so the
envelope (`kvgate.core.plan.forecast`) frees it at the right end. Blocks are named by their
chained hashes (`kvgate.core.prefix.blocks`): a request's held blocks are a leading run of
its prompt's, so a node's held prefix of a prompt is found by bisection.

**Other replicas' requests.** Each replica's view carries, per node, a few hashes of each
prefix its running requests hold (`HeldBlocks.marks`: the blocks at positions 1, 2, 4, ...
and the last, a chain's prefixes named in O(log n) hashes). A request costs a node only
what neither this replica's requests nor the others' hold (`marked_depth`: the whole
prompt when the same prompt runs elsewhere, else at least half of what it shares with
one). The blocks a replica's request shares with another's are counted in the other's
hold: when that one ends first they stay held (the next sample shows them), and the
sharer's own end frees more than its envelope counted.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.index import DEFAULT_BLOCK_SIZE, leading
from kvgate.core.request import AdmissionRequest


class _Run:
    """The blocks one hold owns: spans `[lo, hi)` of positions in its prompt's chain, in
    order (a block's position is the same in every chain that holds it: it names its
    prefix)."""

    __slots__ = ("chain", "node_id", "spans")

    def __init__(self, node_id: str, chain: Sequence[int], spans: list[tuple[int, int]]) -> None:
        self.node_id = node_id
        self.chain = chain
        self.spans = spans


class HeldBlocks:
    """Per node: the owner of each held block. Per hold: the blocks it owns (spans of its
    prompt's chain), the holds sharing them and how many (a sharer holds the leading ones:
    sharing is by prefix), and the owners it shares from."""

    __slots__ = ("_from", "_owned", "_owner", "_sharers")

    def __init__(self) -> None:
        self._owner: dict[str, dict[int, str]] = {}  # node -> block -> owning key
        self._owned: dict[str, _Run] = {}  # key -> what it owns
        self._sharers: dict[str, dict[str, int]] = {}  # owner -> sharer -> blocks
        self._from: dict[str, dict[str, int]] = {}  # sharer -> owner -> blocks

    def held(self, node_id: str, hashes: Sequence[int], most: int) -> int:
        """How many leading blocks of `hashes` (at most `most`) running requests on the
        node hold."""
        owner = self._owner.get(node_id)
        if not owner or not hashes or most <= 0:
            return 0
        return min(most, leading(owner, hashes))

    def holds_any(self, node_id: str) -> bool:
        """Does any running request on the node hold a block?"""
        return bool(self._owner.get(node_id))

    def take(self, key: str, node_id: str, hashes: Sequence[int], most: int) -> int:
        """The hold `key` on the node holds these blocks; returns how many it shares (held
        already, at most `most`: owned by others), the rest it owns."""
        owner = self._owner.get(node_id)
        if owner is None:
            owner = self._owner[node_id] = {}
        held = leading(owner, hashes) if owner and hashes else 0
        shared = min(most, held) if most > 0 else 0
        if shared:
            tally = self._tally(owner, hashes, shared)
            self._from[key] = tally
            for o, n in tally.items():
                self._sharers.setdefault(o, {})[key] = n
        # It owns what nobody holds: the blocks past the held run (a node holds a held
        # block's predecessors). Between `most` and that run (the block of its prompt's last
        # token, which the engine computes again) it neither shares nor owns.
        end = len(hashes)
        owner.update(dict.fromkeys(hashes[held:], key))
        self._owned[key] = _Run(node_id, hashes, [(held, end)] if held < end else [])
        return shared

    def _tally(self, owner: dict[int, str], hashes: Sequence[int], shared: int) -> dict[str, int]:
        """Per owner, how many of the leading `shared` blocks of `hashes` it owns. An owner's
        spans are runs of its chain, which agrees with `hashes` up to where they part (the
        same key at a position names the same prefix): one step per owner's span, not one
        per block."""
        tally: dict[str, int] = {}
        p = 0
        while p < shared:
            o = owner[hashes[p]]
            run = self._owned[o]
            end = next(min(hi, shared) for lo, hi in run.spans if lo <= p < hi)
            chain = run.chain
            if hashes[end - 1] != chain[end - 1]:  # the chains part in the span: where?
                lo, hi = p + 1, end - 1  # hashes[:lo] agree, hashes[hi] does not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if hashes[mid] == chain[mid]:
                        lo = mid + 1
                    else:
                        hi = mid
                end = lo
            tally[o] = tally.get(o, 0) + end - p
            p = end
        return tally

    def drop(self, key: str, last_end: Callable[[str], float]) -> dict[str, int]:
        """The hold `key` ended: returns, per heir key, how many of the blocks it owned
        pass to that heir (still held by others: the sharer holding most of them, the one
        expected to end last among equals, takes them all: the leading ones, by their
        place in the prompt)."""
        run = self._owned.pop(key, None)
        if run is None:
            return {}
        owner = self._owner[run.node_id]
        for o in self._from.pop(key, {}):
            theirs = self._sharers.get(o)
            if theirs is not None:
                theirs.pop(key, None)
        mine = self._sharers.pop(key, None)
        chain = run.chain
        if not mine:
            for lo, hi in run.spans:
                for h in chain[lo:hi]:
                    del owner[h]
            if not owner:
                del self._owner[run.node_id]
            return {}
        heir = max(mine, key=lambda k: (mine[k], last_end(k)))
        n = mine.pop(heir)
        passed, gone = _split(run.spans, n)
        for lo, hi in passed:
            owner.update(dict.fromkeys(chain[lo:hi], heir))
        for lo, hi in gone:
            for h in chain[lo:hi]:
                del owner[h]
        heirs = self._owned[heir]
        heirs.spans = _merge(heirs.spans, passed)  # the heir's chain agrees there
        # The heir no longer shares these from `key`; the other sharers share from the heir.
        came = self._from.get(heir)
        if came is not None:
            came.pop(key, None)
        if mine:
            theirs = self._sharers.setdefault(heir, {})
            for k, c in mine.items():
                theirs[k] = theirs.get(k, 0) + c
                sources = self._from[k]
                del sources[key]
                sources[heir] = sources.get(heir, 0) + c
        return {heir: n}

    def marks(self) -> dict[str, set[int]]:
        """Per node, the hashes that name its held prefixes to another replica: of each
        owner's chain, the blocks at positions 1, 2, 4, 8, ... of its held run, and its
        last (`marked_depth` reads them)."""
        out: dict[str, set[int]] = {}
        for run in self._owned.values():
            if not run.spans:
                continue
            chain, end = run.chain, run.spans[-1][1]
            marks = out.setdefault(run.node_id, set())
            p = 1
            while p <= end:
                marks.add(chain[p - 1])
                p <<= 1
            marks.add(chain[end - 1])
        return out

    def blocks_on(self, node_id: str) -> int:
        """Distinct blocks held on the node."""
        owner = self._owner.get(node_id)
        return 0 if owner is None else len(owner)


def _split(
    spans: list[tuple[int, int]], n: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The first `n` positions of `spans` (in order) and the rest."""
    if not spans:
        return [], []
    lo, hi = spans[0]
    if hi - lo >= n:  # the common case: one span, or the first covers them
        head = [(lo, lo + n)] if n > 0 else []
        return head, ([(lo + n, hi)] if hi > lo + n else []) + spans[1:]
    head = []
    for i, (lo, hi) in enumerate(spans):
        if hi - lo >= n:
            head.append((lo, lo + n))
            return head, ([(lo + n, hi)] if hi > lo + n else []) + spans[i + 1 :]
        head.append((lo, hi))
        n -= hi - lo
    return head, []


def _merge(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of two lists of disjoint spans, in order, adjacent ones joined."""
    if not a or not b:
        return a or b
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(a + b):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def marked_depth(marks: Container[int], hashes: Sequence[int], most: int) -> int:
    """How many leading blocks of `hashes` (at most `most`) another replica's `marks`
    (`HeldBlocks.marks`) show held: the whole run when its last block is marked, else the
    deepest power of two marked (at least half of what the two chains share)."""
    n = min(most, len(hashes))
    if n <= 0:
        return 0
    if hashes[-1] in marks or hashes[n - 1] in marks:
        return n
    p = 1 << (n.bit_length() - 1)
    while p:
        if hashes[p - 1] in marks:
            return p
        p >>= 1
    return 0


def reusable(tokens: int, block_size: int) -> int:
    """The most blocks of a `tokens`-token prompt an engine reuses: never the block of its
    last token, which it computes again to produce the first output."""
    return (tokens - 1) // block_size if tokens > 0 else 0


#: Tokens of recent prompts whose hashes `PromptBlocks` keeps: a walk of the queue's
#: worth of 2k-token waiters (`kvgate.core.flow.controller.MAX_MISSES` refusals and the
#: admissions between them). Their tuples stay alive meanwhile, and are freed here.
RECENT_TOKENS = 1 << 16


class PromptBlocks:
    """The block hashes of recent prompts, computed once per prompt and block size: a
    decision asks for them on every candidate and again when it opens the hold, and a
    waiting request is decided again on every walk of the queue. A prompt is known by
    identity (its request's tuple); the most recent ones, up to `RECENT_TOKENS` tokens in
    all, are kept."""

    __slots__ = ("_recent", "_tokens")

    def __init__(self) -> None:
        # id(ids) -> (ids, block size -> hashes); holding `ids` keeps its id unique.
        self._recent: dict[int, tuple[tuple[int, ...], dict[int, list[int]]]] = {}
        self._tokens = 0

    def of(self, ids: tuple[int, ...], block_size: int) -> list[int]:
        """The hashes of the full blocks of `ids` (`block_hashes`)."""
        recent = self._recent
        entry = recent.get(id(ids))
        if entry is None:
            entry = recent[id(ids)] = (ids, {})
            self._tokens += len(ids)
            while self._tokens > RECENT_TOKENS and len(recent) > 1:
                self._tokens -= len(recent.pop(next(iter(recent)))[0])
        by_size = entry[1]
        out = by_size.get(block_size)
        if out is None:
            out = by_size[block_size] = block_hashes(ids, block_size)
        return out


class PromptSharing:
    """What each request shares on its node, by its prompt's token ids: the policy's part
    over `HeldBlocks`. Only a node whose engine caches prefixes (its block size known, in
    `block_sizes`) shares: elsewhere every prompt counts whole."""

    __slots__ = ("block_sizes", "blocks", "held", "peers")

    def __init__(self, block_sizes: dict[str, int], blocks: PromptBlocks) -> None:
        self.block_sizes = block_sizes
        self.blocks = blocks
        self.held = HeldBlocks()
        # Per node, the other replicas' marks of what their running requests hold there
        # (`set_peers`): a prefix one of them holds costs this replica's requests nothing.
        self.peers: dict[str, Container[int]] = {}

    def set_peers(self, marks: Mapping[str, Container[int]]) -> None:
        """The other replicas' marks per node, as of the last sync (`HeldBlocks.marks`)."""
        self.peers = {node_id: m for node_id, m in marks.items() if m}

    def on(self, node_id: str, ids: tuple[int, ...] | None) -> int:
        """Prompt tokens of `ids` that running requests on the node hold already, this
        replica's or another's (nothing is hashed for a node where none holds a block)."""
        size = self.block_sizes.get(node_id)
        if not ids or not size:
            return 0
        local = self.held.holds_any(node_id)
        marks = self.peers.get(node_id)
        if not local and not marks:
            return 0
        blocks = self.blocks.of(ids, size)
        most = reusable(len(ids), size)
        n = self.held.held(node_id, blocks, most) if local else 0
        if marks:
            n = max(n, marked_depth(marks, blocks, most))
        return n * size

    def lacks(self, node_id: str, request: AdmissionRequest) -> int:
        """Prompt tokens of `request` the node does not hold already: what it costs there."""
        return request.cost.prompt_tokens - self.on(node_id, request.prompt_ids)

    def take(self, key: str, node_id: str, ids: tuple[int, ...] | None) -> int:
        """The hold `key` on the node holds the prompt `ids`: the tokens it shares (held by
        others already); it owns the rest."""
        size = self.block_sizes.get(node_id)
        if not ids or not size:
            return 0
        blocks = self.blocks.of(ids, size)
        most = reusable(len(ids), size)
        shared = self.held.take(key, node_id, blocks, most)
        marks = self.peers.get(node_id)
        if marks:
            shared = max(shared, marked_depth(marks, blocks, most))
        return shared * size

    def drop(self, key: str, node_id: str, last_end: Callable[[str], float]) -> dict[str, int]:
        """The hold `key` ended: per heir, the prompt tokens it owned that pass to that heir
        (`HeldBlocks.drop`)."""
        heirs = self.held.drop(key, last_end)
        if not heirs:
            return heirs
        size = self.block_sizes.get(node_id, DEFAULT_BLOCK_SIZE)
        return {heir: blocks * size for heir, blocks in heirs.items()}
