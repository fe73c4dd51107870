"""Block hashes: full blocks only, chained (a block's key names its whole prefix), the same
in every process whatever its hash seed, and extendable from a list computed before."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from kvgate.core.prefix.blocks import ROOT, block_hash, block_hashes, common_blocks, full_blocks

IDS = tuple(range(100, 140))  # 40 tokens


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(IDS, 16)) == 2 == full_blocks(40, 16)
    assert block_hashes(IDS[:15], 16) == []
    assert len(block_hashes(IDS[:32], 16)) == 2


def test_a_block_is_keyed_by_its_whole_prefix() -> None:
    a = block_hashes(IDS, 8)
    changed = (IDS[0] + 1, *IDS[1:])
    b = block_hashes(changed, 8)
    assert all(x != y for x, y in zip(a, b, strict=True))  # the first token changes every key
    c = block_hashes((*IDS[:16], 7, *IDS[17:]), 8)
    assert c[:2] == a[:2] and all(x != y for x, y in zip(a[2:], c[2:], strict=True))
    assert common_blocks(a, c) == 2
    assert a[0] == block_hash(ROOT, IDS[:8]) and a[1] == block_hash(a[0], IDS[8:16])


def test_lists_and_tuples_give_the_same_hashes() -> None:
    assert block_hashes(list(IDS), 4) == block_hashes(IDS, 4)


@given(st.lists(st.integers(0, 2**31), max_size=80), st.integers(1, 9), st.integers(0, 8))
def test_extending_equals_hashing_the_whole(ids: list[int], bs: int, k: int) -> None:
    whole = block_hashes(ids, bs)
    k = min(k, len(whole))
    head = whole[:k]
    tail = block_hashes(ids, bs, parent=head[-1] if head else ROOT, start=k * bs)
    assert head + tail == whole


# Pinned: a change here means the hashes differ from every other kvgate process that
# hashed the same tokens (another Python build, another algorithm).
GOLDEN = [1713266239490431593, -7320064430402784108]


def test_the_same_in_every_process_whatever_its_hash_seed() -> None:
    code = (
        "from kvgate.core.prefix.blocks import block_hashes;"
        "print(block_hashes(tuple(range(100, 140)), 16))"
    )
    seen = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen.add(out.stdout.strip())
    assert seen == {str(block_hashes(IDS, 16))}
    assert block_hashes(IDS, 16) == GOLDEN
