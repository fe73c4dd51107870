"""Rendezvous hashing: every engine has exactly one owner, the load spreads, and a change
of membership moves only the engines of the member that came or went."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.cluster.shards import assign, by_member, owner

NODES = [f"gpu-{i}:8000" for i in range(64)]


def test_every_engine_has_one_owner_among_the_members() -> None:
    members = ["a", "b", "c"]
    assignment = assign(NODES, members)
    assert set(assignment) == set(NODES)
    assert set(assignment.values()) <= set(members)
    assert sorted(n for nodes in by_member(assignment).values() for n in nodes) == sorted(NODES)


def test_the_owner_does_not_depend_on_the_order_of_members() -> None:
    assert assign(NODES, ["a", "b", "c"]) == assign(NODES, ["c", "a", "b"])


def test_load_spreads_over_members() -> None:
    members = [f"replica-{i}" for i in range(4)]
    counts = {m: len(nodes) for m, nodes in by_member(assign(NODES, members)).items()}
    assert len(counts) == 4
    assert min(counts.values()) >= 8, counts  # 16 each on average


@given(
    st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=6, unique=True),
    st.integers(min_value=0, max_value=5),
)
def test_a_leaving_member_moves_only_its_own_engines(members: list[str], gone: int) -> None:
    leaving = members[gone % len(members)]
    rest = [m for m in members if m != leaving]
    before = assign(NODES, members)
    after = assign(NODES, rest)
    for node in NODES:
        if before[node] != leaving:
            assert after[node] == before[node]
        else:
            assert after[node] in rest


def test_a_single_member_owns_everything() -> None:
    assert {owner(n, ["solo"]) for n in NODES} == {"solo"}
