"""Which replica scrapes which engine: rendezvous (highest random weight) hashing.

Every replica computes the same owner for an engine from the same list of live members
(each tick reads it from the store), without talking: the owner is the member whose
hash with the engine's id is highest. When a member joins or leaves, only the engines it
gains or held move (about 1/N of them), every other engine keeps its scraper.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence


def weight(member: str, node_id: str) -> int:
    digest = hashlib.blake2b(f"{member}\0{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(node_id: str, members: Sequence[str]) -> str:
    """The member that scrapes `node_id` (ties, which need equal 64-bit hashes, go to the
    smallest member id)."""
    if not members:
        raise ValueError("no member to own an engine")
    return max(members, key=lambda m: (weight(m, node_id), m))


def assign(node_ids: Iterable[str], members: Sequence[str]) -> dict[str, str]:
    """Every engine's owner."""
    return {node_id: owner(node_id, members) for node_id in node_ids}


def by_member(assignment: Mapping[str, str]) -> dict[str, list[str]]:
    """The engines each member owns, sorted."""
    out: dict[str, list[str]] = {}
    for node_id, member in sorted(assignment.items()):
        out.setdefault(member, []).append(node_id)
    return out
