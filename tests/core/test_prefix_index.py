"""The prefix index (an LRU of block hashes per engine) and the KV-event tracker."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given
from hypothesis import strategies as st

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvgate.core.prefix.index import PrefixIndex
from kvgate.core.prefix.tracker import EventTracker

BS = 4


def _ids(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_matched_is_the_cached_leading_run() -> None:
    index = PrefixIndex()
    a = block_hashes(_ids(40), BS)  # 10 blocks
    index.store("n", a[:6])
    assert index.matched("n", a) == 6
    assert index.matched("n", a[:3]) == 3
    assert index.matched("other", a) == 0
    other = block_hashes((99, *_ids(39)), BS)
    assert index.matched("n", other) == 0
    assert index.deepest(a) == (6, ("n",))
    index.store("m", a)
    assert index.deepest(a) == (10, ("m",))
    depth, holders = index.deepest(a[:5])
    assert depth == 5 and set(holders) == {"n", "m"}


def test_lru_evicts_the_least_recent_prompt_leaf_first() -> None:
    index = PrefixIndex()
    index.resize("n", 8)
    shared = _ids(16)  # 4 shared blocks
    x = block_hashes(shared + _ids(8, 100), BS)  # 6 blocks
    y = block_hashes(shared + _ids(8, 200), BS)
    index.store("n", x)
    index.store("n", y)  # 8 distinct blocks: all fit
    assert index.blocks("n") == 8
    z = block_hashes(shared + _ids(8, 300), BS)
    index.store("n", z)  # 2 more: x's two leaves go (x is the least recent)
    assert index.blocks("n") == 8
    assert index.matched("n", x) == 4
    assert index.matched("n", y) == 6 and index.matched("n", z) == 6
    index.resize("n", 4)
    assert index.blocks("n") == 4
    assert index.matched("n", z) == 4  # the shared prefix was touched last


def test_remove_and_clear_drop_holders() -> None:
    index = PrefixIndex()
    a = block_hashes(_ids(20), BS)
    index.store("n", a)
    index.store("m", a)
    index.remove("n", a[3:])
    assert index.matched("n", a) == 3
    index.clear("m")
    assert index.deepest(a) == (3, ("n",))
    index.forget("n")
    assert index.deepest(a) == (0, ())


def _stored(ids: tuple[int, ...], parent: int | None, keys: list[int]) -> BlockStored:
    return BlockStored(tuple(keys), parent, ids, BS)


def test_tracker_maps_engine_keys_to_kvgate_hashes() -> None:
    index = PrefixIndex()
    tracker = EventTracker(index)
    ids = _ids(24)
    ours = block_hashes(ids, BS)
    # The engine's keys are its own (here 1000 + i); the second batch chains on the first.
    assert tracker.apply("e", KVEventBatch(0.0, (_stored(ids[:8], None, [1000, 1001]),), seq=1))
    assert tracker.apply(
        "e", KVEventBatch(0.1, (_stored(ids[8:], 1001, [1002, 1003, 1004, 1005]),), seq=2)
    )
    assert index.matched("e", ours) == 6
    assert tracker.apply("e", KVEventBatch(0.2, (BlockRemoved((1005, 1004)),), seq=3))
    assert index.matched("e", ours) == 4
    assert tracker.apply("e", KVEventBatch(0.3, (AllBlocksCleared(),), seq=4))
    assert index.matched("e", ours) == 0


def test_tracker_clears_an_engine_whose_events_were_lost() -> None:
    index = PrefixIndex()
    tracker = EventTracker(index)
    ids = _ids(16)
    assert tracker.apply("e", KVEventBatch(0.0, (_stored(ids[:8], None, [1, 2]),), seq=7))
    # seq 8 lost: what seq 9 says cannot be trusted to complete the picture.
    assert not tracker.apply("e", KVEventBatch(0.2, (), seq=9))
    assert index.blocks("e") == 0 and tracker.resyncs["e"] == 1
    # A block whose parent the tracker never saw: cleared too, the batch's rest applies.
    assert not tracker.apply("e", KVEventBatch(0.3, (_stored(ids[8:], 2, [3, 4]),), seq=10))
    assert tracker.apply("e", KVEventBatch(0.4, (_stored(ids[:4], None, [1]),), seq=11))
    assert index.matched("e", block_hashes(ids, BS)) == 1


@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 2), st.integers(1, 4), st.integers(0, 3)),
        max_size=25,
    )
)
def test_store_touches_each_block_last_to_first(ops: list[tuple[bool, int, int, int]]) -> None:
    """Whatever the engine cached or evicted before (gaps in a prompt's cached blocks
    included), storing a prompt leaves each block where touching its blocks one by one,
    from its last to its first, would: the least recent first, holders kept."""
    index = PrefixIndex()
    index.resize("n", 12)
    model: OrderedDict[int, None] = OrderedDict()
    for remove, branch, depth, gap in ops:
        hashes = block_hashes(_ids(4) + _ids(BS * depth, 100 * branch), BS)
        if remove:
            gone = hashes[min(gap, len(hashes) - 1) :][:1]
            index.remove("n", gone)
            for h in gone:
                model.pop(h, None)
            continue
        index.store("n", hashes)
        for h in reversed(hashes):
            model[h] = None
            model.move_to_end(h)
        while len(model) > 12:
            model.popitem(last=False)
        assert list(index._caches["n"]) == list(model)
        assert {h for h, who in index._holders.items() if who == "n"} == set(model)


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 3), st.integers(0, 2), st.integers(1, 3)),
        max_size=30,
    )
)
def test_holders_follow_every_engines_cache(ops: list[tuple[str, int, int, int]]) -> None:
    """Stored, evicted (small caches), removed, cleared: each block's holders are exactly the
    engines whose cache holds it, and `deepest` names them."""
    index = PrefixIndex()
    for node in "abc":
        index.resize(node, 6)
    for node, op, branch, depth in ops:
        hashes = block_hashes(_ids(4) + _ids(BS * depth, 100 * branch), BS)
        if op == 0:
            index.remove(node, hashes[-1:])
        elif op == 1 and branch == 0:
            index.clear(node)
        else:
            index.store(node, hashes)
        held = {n: set(index._caches.get(n, ())) for n in "abc"}
        blocks = set().union(*held.values())
        assert set(index._holders) == blocks
        for h in blocks:
            nodes = {n for n in "abc" if h in held[n]}
            depth, who = index.deepest([h])
            assert depth == 1 and set(who) == nodes and len(who) == len(nodes)
