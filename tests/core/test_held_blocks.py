"""Shared prompt blocks counted once: a request costs a node only what it lacks there."""

from __future__ import annotations

import random
from dataclasses import replace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.core.admission import Admit, Outcome, Ticket
from kvgate.core.flow import TokenFairness, WaitQueue
from kvgate.core.policies.base import BasePolicy
from kvgate.core.prefix.blocks import block_hashes, common_blocks
from kvgate.core.prefix.held import HeldBlocks, marked_depth
from kvgate.core.replicas.exchange import ReplicaExchange
from kvgate.core.replicas.view import PeerView
from kvgate.core.request import RequestCost
from kvgate.core.tenants import TenantLedger

from .helpers import admit, assert_books_empty, make, sample

SYSTEM = tuple(range(1000, 2024))  # 1,024 tokens: 64 blocks of 16
OVH = 16


def _prompt(user: int, n: int = 256) -> tuple[int, ...]:
    return SYSTEM + tuple(range(user * 10_000, user * 10_000 + n))


def _policy() -> BasePolicy:
    policy, clock = make("headroom-only")
    # An engine with prefix caching (its block size known): only such an engine shares.
    policy.observe("a", replace(sample(clock, usage=0.0, capacity=100_000), block_size=16))
    return policy


def _admit(policy: BasePolicy, rid: str, ids: tuple[int, ...] | None, out: int = 100) -> Ticket:
    n = len(ids) if ids is not None else 1280
    decision = admit(policy, rid, RequestCost(n, out), prompt_ids=ids)
    assert isinstance(decision, Admit)
    return decision.ticket


def _reserved(policy: BasePolicy) -> int:
    return int(policy.snapshot()["nodes"]["a"]["reserved_tokens"])


def test_a_shared_prefix_is_counted_once() -> None:
    policy = _policy()
    first = _admit(policy, "r0", _prompt(1))
    assert _reserved(policy) == 1280 + 100 + OVH
    assert (
        policy.sharing.on("a", first.request.prompt_ids) == 1024 + 256 - 16
    )  # all but its last block
    second = _admit(policy, "r1", _prompt(2))
    # The second holds only its own 256 prompt tokens: the system prompt is held already.
    assert _reserved(policy) == (1280 + 100 + OVH) + (256 + 100 + OVH)
    for t in (first, second):
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_a_shared_prefix_frees_with_its_last_holder() -> None:
    policy = _policy()
    first = _admit(policy, "r0", _prompt(1), out=100)
    second = _admit(policy, "r1", _prompt(2), out=400)
    third = _admit(policy, "r2", _prompt(3), out=200)
    # The first (the owner) ends: the system prompt stays held, now by the one expected to
    # end last (the second: 400 tokens to go).
    policy.release(first, Outcome.DONE)
    assert _reserved(policy) == (1280 + 400 + OVH) + (256 + 200 + OVH)
    holds = policy.holds.live
    assert holds[second.key].prompt == 1280 and holds[third.key].prompt == 256
    policy.release(second, Outcome.DONE)
    assert _reserved(policy) == 1280 + 200 + OVH  # the third inherits it in turn
    policy.release(third, Outcome.DONE)
    assert_books_empty(policy)


def test_a_reflected_shared_prefix_stays_reflected_when_it_passes_on() -> None:
    policy, clock = make("headroom-only", reflect_margin_s=0.0)
    policy.observe("a", sample(clock, usage=0.0, capacity=100_000))
    first = _admit(policy, "r0", _prompt(1))
    second = _admit(policy, "r1", _prompt(2))
    clock.advance(0.05)
    policy.on_first_token(first)
    policy.on_first_token(second)
    clock.advance(0.05)
    # The engine holds both prompts, the shared blocks once.
    policy.observe("a", sample(clock, usage=(1280 + 256) / 100_000, capacity=100_000))
    assert _reserved(policy) == 2 * (100 + OVH)
    policy.release(first, Outcome.DONE)
    # Still in the engine (its sample), still reflected: only the second's output is held.
    assert _reserved(policy) == 100 + OVH
    policy.release(second, Outcome.DONE)
    assert_books_empty(policy)


def test_a_prompt_without_token_ids_counts_whole() -> None:
    policy = _policy()
    first = _admit(policy, "r0", _prompt(1))
    second = _admit(policy, "r1", None)
    assert _reserved(policy) == 2 * (1280 + 100 + OVH)
    for t in (first, second):
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_ids_counted_after_the_start_share_then_and_are_shared() -> None:
    """A burst's first request started on the estimate (no ids, 1,500 tokens guessed); its
    count arrives while it runs: its hold takes the exact 1,280 tokens and owns their
    blocks, so the next request with the same system prompt shares them."""
    policy = _policy()
    early = _admit(policy, "r0", None)
    guessed = replace(early.request, cost=RequestCost(1500, 100))
    early.request = guessed
    policy.holds.recount(policy.holds.live[early.key], 1280, 1500, 0)  # the guess, as held
    assert _reserved(policy) == 1500 + 100 + OVH
    policy.recount(early, replace(guessed, cost=RequestCost(1280, 100), prompt_ids=_prompt(1)))
    assert early.request.prompt_ids == _prompt(1)
    assert _reserved(policy) == 1280 + 100 + OVH
    second = _admit(policy, "r1", _prompt(2))
    assert _reserved(policy) == (1280 + 100 + OVH) + (256 + 100 + OVH)
    # A second count changes nothing: the hold has its ids.
    policy.recount(early, replace(guessed, prompt_ids=_prompt(3)))
    assert _reserved(policy) == (1280 + 100 + OVH) + (256 + 100 + OVH)
    # Its blocks pass on as any owner's do.
    policy.release(early, Outcome.DONE)
    assert _reserved(policy) == 1280 + 100 + OVH
    policy.release(second, Outcome.DONE)
    policy.recount(second, replace(second.request, prompt_ids=_prompt(4)))  # ended: nothing
    assert_books_empty(policy)


def test_a_late_count_after_the_prompt_is_reflected_keeps_the_books_whole() -> None:
    """The count comes after a sample reflected the request's (guessed) prompt: what was
    reflected stays within its new footprint, and release empties the books."""
    policy, clock = make("headroom-only", reflect_margin_s=0.0)
    policy.observe("a", replace(sample(clock, usage=0.0, capacity=100_000), block_size=16))
    first = _admit(policy, "r0", _prompt(1))
    late = _admit(policy, "r1", None)  # 1,280 guessed, 256 of them its own
    clock.advance(0.05)
    policy.on_first_token(first)
    policy.on_first_token(late)
    clock.advance(0.05)
    policy.observe(
        "a", replace(sample(clock, usage=1536 / 100_000, capacity=100_000), block_size=16)
    )
    policy.recount(late, replace(late.request, prompt_ids=_prompt(2)))
    hold = policy.holds.live[late.key]
    # Its reflected prompt is its own 256 tokens now: only the two outputs are held.
    assert hold.prompt == 256 and hold.reflected == 256
    assert _reserved(policy) == 2 * (100 + OVH)
    for t in (first, late):
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_a_node_is_asked_only_for_what_it_lacks() -> None:
    policy, clock = make("headroom-only")
    # Room under the panic watermark (0.92 x 3,000 = 2,760) for one 1,396-token request,
    # not two: the second fits only because the system prompt is held there already.
    policy.observe("a", replace(sample(clock, usage=0.0, capacity=3000), block_size=16))
    first = _admit(policy, "r0", _prompt(1))
    second = _admit(policy, "r1", _prompt(2))
    third = admit(policy, "r2", RequestCost(1280, 100))  # no ids: its whole length
    assert not isinstance(third, Admit)
    for t in (first, second):
        policy.release(t, Outcome.DONE)
    assert_books_empty(policy)


def test_the_ledger_passes_each_block_to_a_holder_until_the_last_ends() -> None:
    from kvgate.core.prefix.blocks import block_hashes
    from kvgate.core.prefix.held import HeldBlocks

    held = HeldBlocks()
    a = block_hashes(tuple(range(64)), 16)  # 4 blocks
    b = block_hashes(tuple(range(64)) + tuple(range(500, 532)), 16)  # a's 4 + 2 more
    c = block_hashes(tuple(range(64)) + tuple(range(500, 532)) + tuple(range(900, 916)), 16)
    ends = {"A": 1.0, "B": 2.0, "C": 3.0}
    assert held.take("A", "n", a, 99) == 0
    assert held.take("B", "n", b, 99) == 4
    assert held.take("C", "n", c, 99) == 6  # 4 owned by A, 2 by B
    assert held.blocks_on("n") == 7
    # A ends first: B and C both hold its 4 blocks; C is expected to end last.
    assert held.drop("A", ends.__getitem__) == {"C": 4}
    assert held.blocks_on("n") == 7
    # B ends: its 2 blocks are C's too.
    assert held.drop("B", ends.__getitem__) == {"C": 2}
    assert held.held("n", c, 99) == 7
    assert held.drop("C", ends.__getitem__) == {}
    assert held.blocks_on("n") == 0 and held.held("n", a, 99) == 0


def test_an_engine_without_prefix_caching_shares_nothing() -> None:
    """Without a block size (vLLM's `enable_prefix_caching` off) every request holds its
    whole prompt, however many share it: such an engine stores each copy."""
    policy, clock = make("headroom-only")
    policy.observe("a", sample(clock, usage=0.0, capacity=100_000))
    first = _admit(policy, "r0", _prompt(1))
    assert policy.sharing.on("a", first.request.prompt_ids) == 0
    _admit(policy, "r1", _prompt(1))
    assert _reserved(policy) == 2 * (1280 + 100 + OVH)


def test_blocks_inherited_out_of_order_pass_on_by_their_place_in_the_prompt() -> None:
    """A holder that inherits a later part of its prompt before an earlier one passes on,
    when it ends, the blocks its sharers hold: the leading ones of its prompt, not the
    first it happened to inherit."""
    from kvgate.core.prefix.blocks import block_hashes
    from kvgate.core.prefix.held import HeldBlocks

    held = HeldBlocks()
    p, q = tuple(range(64)), tuple(range(500, 532))
    a = block_hashes(p, 16)  # 4 blocks
    b = block_hashes(p + q, 16)  # a's 4 + 2
    c = block_hashes(p + q + tuple(range(900, 916)), 16)  # b's 6 + 1
    d = block_hashes(p + tuple(range(700, 716)), 16)  # a's 4 + 1 of its own
    ends = {"A": 1.0, "B": 2.0, "C": 3.0, "D": 4.0, "E": 5.0}
    held.take("A", "n", a, 99)
    held.take("B", "n", b, 99)
    held.take("C", "n", c, 99)
    assert held.drop("A", ends.__getitem__) == {"C": 4}  # C owns blocks 0-3 and 6
    assert held.drop("B", ends.__getitem__) == {"C": 2}  # and 4-5
    assert held.take("D", "n", d, 99) == 4  # shares blocks 0-3 from C
    # C ends: D holds its blocks 0-3, not 4-5 (B's prompt, which nobody holds any more).
    assert held.drop("C", ends.__getitem__) == {"D": 4}
    assert held.blocks_on("n") == 5
    assert held.held("n", d, 99) == 5 and held.held("n", b, 99) == 4
    assert held.take("E", "n", b, 99) == 4  # blocks 0-3 are D's
    assert held.drop("D", ends.__getitem__) == {"E": 4}
    assert held.drop("E", ends.__getitem__) == {}
    assert held.blocks_on("n") == 0


@settings(max_examples=400)  # enough to meet holds inheriting out of their prompts' order
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=30),
    st.randoms(use_true_random=False),
)
def test_the_ledger_holds_exactly_the_running_prompts_blocks(
    steps: list[tuple[int, int]], rnd: random.Random
) -> None:
    """Whatever order holds start and end in: the node holds the union of the running
    prompts' blocks, each owned by exactly one of them (what they own adds up), and a
    newcomer shares the longest run of its prompt any of them holds (every block may be
    shared here: `most` is the whole prompt)."""
    from kvgate.core.prefix.blocks import block_hashes
    from kvgate.core.prefix.held import HeldBlocks

    # Prompts from a small tree: every branch shares the first block, branches 2k and
    # 2k + 1 the second too; a prompt is a branch's first 1 + `depth` blocks.
    def chain(branch: int, depth: int) -> list[int]:
        group = tuple(range(1000 + 16 * (branch // 2), 1016 + 16 * (branch // 2)))
        ids = tuple(range(16)) + group + tuple(range(100 * branch, 100 * branch + 32))
        return block_hashes(ids[: 16 * (1 + depth)], 16)

    held = HeldBlocks()
    live: dict[str, list[int]] = {}
    owned: dict[str, int] = {}
    ends: dict[str, float] = {}
    for i, (branch, depth) in enumerate(steps):
        if live and rnd.random() < 0.4:
            key = rnd.choice(sorted(live))
            for heir, n in held.drop(key, ends.__getitem__).items():
                owned[heir] += n
            del live[key], owned[key]
        key = f"k{i}"
        hashes = chain(branch % 4, depth)
        best = max((common_blocks(hashes, c) for c in live.values()), default=0)
        ends[key] = rnd.random()
        assert held.take(key, "n", hashes, len(hashes)) == best
        owned[key] = len(hashes) - best
        live[key] = hashes
        union = {h for c in live.values() for h in c}
        assert held.blocks_on("n") == len(union) == sum(owned.values())
        for c in live.values():
            assert held.held("n", c, len(c)) == len(c)
    for key in list(live):
        for heir, n in held.drop(key, ends.__getitem__).items():
            owned[heir] += n
        del live[key], owned[key]
        assert held.blocks_on("n") == len({h for c in live.values() for h in c})
    assert held.blocks_on("n") == 0


def test_prompt_blocks_hash_a_recent_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt decided again (a waiter, on each walk of the queue) is not hashed again
    while it is among the recent ones; the oldest go past `RECENT_TOKENS` tokens."""
    from kvgate.core.prefix import held as module

    calls: list[int] = []

    def counted(ids: tuple[int, ...], size: int) -> list[int]:
        calls.append(len(ids))
        return block_hashes(ids, size)

    monkeypatch.setattr(module, "block_hashes", counted)
    monkeypatch.setattr(module, "RECENT_TOKENS", 4096)
    blocks = module.PromptBlocks()
    a, b, c = (tuple(range(n, n + 2048)) for n in (0, 10_000, 20_000))
    assert blocks.of(a, 16) == block_hashes(a, 16)
    blocks.of(b, 16)
    blocks.of(a, 16)
    blocks.of(b, 16)
    assert len(calls) == 2  # each hashed once
    blocks.of(a, 32)
    assert len(calls) == 3  # another block size hashes again
    blocks.of(c, 16)  # 6,144 tokens: the oldest (a) goes
    blocks.of(b, 16)
    assert len(calls) == 4
    blocks.of(a, 16)
    assert len(calls) == 5


def _replica(name: str) -> tuple[BasePolicy, ReplicaExchange]:
    policy = _policy()
    return policy, ReplicaExchange(policy, WaitQueue(TokenFairness()), TenantLedger(), name)


def _sync(source: ReplicaExchange, target: ReplicaExchange) -> None:
    """`source`'s view reaches `target` through its wire form (JSON, as the store moves it)."""
    now = source.policy.clock.now()
    wire = orjson.loads(orjson.dumps(source.local_view(now).to_json()))
    target.set_peer_views([PeerView.from_json(wire)], 2, now)


def test_a_prefix_held_by_another_replicas_request_counts() -> None:
    """Two replicas in front of one engine: a request of one replica holds a 1,024-token
    system prompt there; the other replica's requests with that prompt cost the node only
    their own part, until the holder ends."""
    a, ex_a = _replica("A")
    b, ex_b = _replica("B")
    first = _admit(a, "r0", _prompt(1))
    for _ in range(2):  # each claims its part of the node's room, and sees the other's
        _sync(ex_b, ex_a)
        _sync(ex_a, ex_b)
    assert b.sharing.on("a", _prompt(1)) == 1280 - 16  # the same prompt: all but its last block
    assert b.sharing.on("a", _prompt(2)) == 1024  # the system prompt
    assert b.sharing.on("a", tuple(range(50_000, 51_280))) == 0  # nothing in common
    second = _admit(b, "s0", _prompt(2))
    assert _reserved(b) == 256 + 100 + OVH
    other = tuple(range(60_000, 61_280))  # another system prompt, held by A's request too
    third = _admit(a, "r1", other)
    _sync(ex_a, ex_b)
    assert b.sharing.on("a", other) == 1280 - 16
    # A's requests ended: its next view marks nothing; B's own request still holds the
    # first system prompt, the other one counts whole again.
    a.release(first, Outcome.DONE)
    a.release(third, Outcome.DONE)
    _sync(ex_a, ex_b)
    assert not b.sharing.peers
    assert b.sharing.on("a", _prompt(3)) == 1024
    assert b.sharing.on("a", other) == 0
    b.release(second, Outcome.DONE)
    assert_books_empty(b)
    assert_books_empty(a)


def test_the_marks_name_a_long_shared_prefix_within_half() -> None:
    """A peer's marks (positions 1, 2, 4, ... and the last of each held run) find at least
    half of the prefix a prompt shares with a held one, the whole of an identical one."""
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randint(2, 300)
        held = [rng.getrandbits(60) for _ in range(n)]
        blocks = HeldBlocks()
        blocks.take("k", "a", held, n)
        marks = blocks.marks()["a"]
        assert len(marks) <= n.bit_length() + 1
        common = rng.randint(0, n)
        mine = held[:common] + [rng.getrandbits(60) for _ in range(rng.randint(0, 50))]
        found = marked_depth(marks, mine, len(mine))
        assert common / 2 <= found <= common or (common == 0 and found == 0)
        assert marked_depth(marks, held, n) == n
