"""Block hashes: the key of each full KV block of a token sequence, as vLLM's prefix cache
keys them.

An engine with prefix caching splits a request's tokens into blocks of `block_size` and
caches every *full* block under a hash of its tokens chained to the hash of the block
before it, so that a block's key names the whole prefix that ends with it: two requests
share block `i` exactly when their first `(i + 1) * block_size` tokens are equal. A
partial last block is never cached.

kvgate computes its own hashes the same way (vLLM's are seeded per deployment, so they
are mapped to these from the token ids a KV event carries, never compared directly):

    h(0) = hash((ROOT, ids[0:bs]))
    h(i) = hash((h(i - 1), ids[i*bs:(i+1)*bs]))

`hash` of a tuple of ints is CPython's, which is not salted (`PYTHONHASHSEED` salts str
and bytes only) and has been the same algorithm since Python 3.8 on 64-bit builds: the
same tokens give the same hashes in every process, replica and simulated engine. The
token ids are the ones the engine sees (chat template and special tokens applied), as
`AdmissionRequest.prompt_ids` carries them. A 2k-token prompt in blocks of 16 hashes in
about 20-25 us (CPython builds and hashes the blocks' tuples in C; one Python step per
block chains them); callers keep what they hashed (`kvgate.core.prefix.held.PromptBlocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

#: The parent of a sequence's first block (vLLM's `NONE_HASH`).
ROOT = 0x6B76_6761_7465  # "kvgate"


def full_blocks(tokens: int, block_size: int) -> int:
    """How many full blocks `tokens` tokens fill (the blocks an engine can cache)."""
    return tokens // block_size


def block_hash(parent: int, block: tuple[int, ...]) -> int:
    """The hash of one full block of token ids, chained to its `parent`'s hash."""
    return hash((parent, block))


def block_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = ROOT, start: int = 0
) -> list[int]:
    """The chained hashes of the full blocks of `token_ids[start:]`, in order.

    `start` (a multiple of `block_size`) and `parent` (the hash of the block that ends at
    `start`) extend a list computed before: `block_hashes(ids, bs)` equals
    `block_hashes(ids[:k * bs], bs) + block_hashes(ids, bs, parent=<its last>, start=k * bs)`.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if start % block_size:
        raise ValueError("start must be a multiple of block_size")
    # One iterator zipped with itself `block_size` times: zip builds each block's tuple in
    # C and stops before a partial last block; the loop only chains.
    tokens = iter(token_ids) if not start else islice(token_ids, start, None)
    out: list[int] = []
    append = out.append
    for block in zip(*[tokens] * block_size, strict=False):
        parent = hash((parent, block))
        append(parent)
    return out


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading block hashes two lists share (the blocks a prefix cache reuses)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
