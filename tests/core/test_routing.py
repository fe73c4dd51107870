"""The routing part of the adaptive policy: headroom-only and prefix-aware."""

from __future__ import annotations

from kvgate.core.admission import Admit, Outcome
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.routing import HeadroomRouting, PrefixRouting
from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.prefix.events import BlockStored, KVEventBatch
from kvgate.core.request import RequestCost

from .helpers import admit, make, request, sample

NODES = ("a", "b", "c", "d")
SYSTEM = tuple(range(1000, 2024))  # 1,024 tokens: 64 blocks of 16


def _prompt(user: int, n: int = 256) -> tuple[int, ...]:
    return SYSTEM + tuple(range(user * 10_000, user * 10_000 + n))


def _admit(
    policy: AdaptivePolicy, rid: str, ids: tuple[int, ...], nodes: tuple[str, ...] = NODES
) -> Admit:
    decision = admit(policy, rid, RequestCost(len(ids), 100), candidates=nodes, prompt_ids=ids)
    assert isinstance(decision, Admit)
    return decision


def _policy(name: str, nodes: tuple[str, ...] = NODES, usage: float = 0.1) -> AdaptivePolicy:
    policy, clock = make(name)
    assert isinstance(policy, AdaptivePolicy)
    for n in nodes:
        policy.observe(n, sample(clock, usage=usage, capacity=100_000))
    return policy


def test_prefix_routing_follows_the_cached_prefix() -> None:
    policy = _policy("prefix-aware")
    assert isinstance(policy.routing, PrefixRouting)
    first = _admit(policy, "r0", _prompt(1)).ticket
    assert first.route == "prefix 0/1280"
    # Once its prefill is done, the same system prompt for another user goes to the node
    # that has it cached (before, it would wait behind that prefill: see the next test).
    policy.on_first_token(first)
    second = _admit(policy, "r1", _prompt(2)).ticket
    assert second.node_id == first.node_id
    assert second.route == "prefix 1024/1280"
    # The first user's next turn: the whole previous prompt is cached there.
    policy.on_first_token(second)
    third = _admit(policy, "r2", _prompt(1, 512)).ticket
    assert third.node_id == first.node_id
    assert third.route == "prefix 1280/1536"


def test_a_prefill_queued_on_the_cached_node_counts_against_it() -> None:
    policy = _policy("prefix-aware")
    first = _admit(policy, "r0", _prompt(1)).ticket
    # Its 1,280 tokens are still being prefilled there: 256 more after them is a longer
    # wait than 1,280 on an idle node.
    second = _admit(policy, "r1", _prompt(2)).ticket
    assert second.node_id != first.node_id
    assert second.route == "prefix 0/1280"


def test_headroom_routing_ignores_the_cache() -> None:
    policy = _policy("headroom-only")
    assert isinstance(policy.routing, HeadroomRouting)
    nodes = {_admit(policy, f"r{i}", _prompt(i)).ticket.node_id for i in range(8)}
    assert len(nodes) > 1
    assert policy.snapshot()["controller"]["routing"] == "headroom"


def test_a_hot_prefix_spreads_when_its_node_fills() -> None:
    policy = _policy("prefix-aware", usage=0.0)
    placed = [_admit(policy, f"r{i}", _prompt(i)).ticket for i in range(60)]
    per_node = {n: sum(t.node_id == n for t in placed) for n in NODES}
    assert max(per_node.values()) < 60  # it spread
    # ... and the node holding it stayed first while its plan was emptier than its cache hit.
    assert per_node[placed[0].node_id] == max(per_node.values())
    for snap in policy.snapshot()["nodes"].values():
        assert snap["peak_usage"] <= 0.92 + 1e-9


def test_a_node_that_cannot_take_the_request_is_never_chosen_for_its_cache() -> None:
    policy, clock = make("prefix-aware")
    assert isinstance(policy, AdaptivePolicy)
    policy.observe("a", sample(clock, usage=0.1, capacity=10_000))
    policy.observe("b", sample(clock, usage=0.1, capacity=10_000))
    first = _admit(policy, "r0", _prompt(1), ("a", "b")).ticket
    # The cached node fills up (a sample at its panic watermark).
    policy.observe(first.node_id, sample(clock, usage=0.95, capacity=10_000))
    second = _admit(policy, "r1", _prompt(2), ("a", "b")).ticket
    assert second.node_id != first.node_id
    assert second.route.startswith("prefix 0/")
    policy.release(first, Outcome.DONE)
    policy.release(second, Outcome.DONE)


def test_kv_events_feed_the_index_and_many_nodes_check_the_cached_ones() -> None:
    nodes = tuple(f"n{i}" for i in range(64))
    policy = _policy("prefix-aware", nodes)
    ids = _prompt(7)
    hashes = block_hashes(ids, 16)
    stored = BlockStored(tuple(range(len(hashes))), None, ids[: len(hashes) * 16], 16)
    policy.kv_events("n42", KVEventBatch(0.0, (stored,), seq=1))
    # Two random choices among 64 would rarely find n42; the route names it.
    ticket = _admit(policy, "r", ids, nodes).ticket
    assert ticket.node_id == "n42"
    assert ticket.route == f"prefix {(len(ids) - 1) // 16 * 16}/{len(ids)}"


def test_holders_add_no_check_when_a_random_pick_caches_as_deep() -> None:
    """A system prompt cached on every engine: the two random picks hold it as deep as any
    holder, so the route names no extra node (each would cost a check and save no
    prefill); a longer prefix held by one node is still named."""
    nodes = tuple(f"n{i}" for i in range(64))
    policy = _policy("prefix-aware", nodes)
    routing = policy.routing
    assert isinstance(routing, PrefixRouting)
    for n in nodes:
        routing.index.store(n, block_hashes(SYSTEM, 16))
    fresh = _prompt(9)
    route = routing.query(
        request("r1", RequestCost(len(fresh), 100), candidates=nodes, prompt_ids=fresh)
    )
    assert route.extra("n1", "n2") == ()
    routing.index.store("n42", block_hashes(_prompt(8), 16))  # the whole of another prompt
    again = _prompt(8)
    route = routing.query(
        request("r2", RequestCost(len(again), 100), candidates=nodes, prompt_ids=again)
    )
    assert route.extra("n1", "n2") == ("n42",) and route.extra("n42", "n1") == ()


def test_without_token_ids_prefix_routing_ranks_by_headroom() -> None:
    policy = _policy("prefix-aware")
    decision = admit(policy, "r", RequestCost(500, 100), candidates=NODES)
    assert isinstance(decision, Admit)
    assert decision.ticket.route == "headroom"


def test_the_engine_block_size_and_hit_rate_come_from_its_samples() -> None:
    import dataclasses

    policy, clock = make("prefix-aware")
    assert isinstance(policy, AdaptivePolicy)
    seen = dataclasses.replace(
        sample(clock, usage=0.1, capacity=100_000),
        block_size=32,
        prefix_hits_total=300.0,
        prefix_queries_total=400.0,
    )
    policy.observe("a", seen)
    assert policy.block_sizes["a"] == 32
    ticket = _admit(policy, "r0", _prompt(1), ("a",)).ticket
    policy.on_first_token(ticket)
    again = _admit(policy, "r1", _prompt(2), ("a",)).ticket
    assert again.route == "prefix 1024/1280"  # 32 blocks of 32
    node = policy.snapshot()["nodes"]["a"]
    assert node["prefix_hit_rate_seen"] == 0.75
    assert node["prefix_index_blocks"] == 40 + 8


def test_an_engine_whose_counters_start_again_has_an_empty_cache() -> None:
    import dataclasses

    policy, clock = make("prefix-aware")
    assert isinstance(policy, AdaptivePolicy) and isinstance(policy.routing, PrefixRouting)
    base = sample(clock, usage=0.1, capacity=100_000)
    policy.observe("a", dataclasses.replace(base, prefix_queries_total=5000.0))
    _admit(policy, "r0", _prompt(1), ("a",))
    assert policy.snapshot()["nodes"]["a"]["prefix_index_blocks"] == 80
    clock.advance(0.05)
    restarted = sample(clock, usage=0.0, capacity=100_000)
    policy.observe("a", dataclasses.replace(restarted, prefix_queries_total=0.0))
    node = policy.snapshot()["nodes"]["a"]
    assert node["prefix_index_blocks"] == 0 and node["prefix_resyncs"] == 1
