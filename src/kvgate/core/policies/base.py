"""What every placement policy shares: node states, holds, exact release, the KV envelope.

Holds: what the policy counts for each admitted request
-------------------------------------------------------
A request's KV footprint grows from its prompt (after prefill) to prompt + output. For each
live ticket the policy keeps a *hold*: the prompt `P` (estimated), the output cap `M`, the
expected output `E` (learned, see `kvgate.core.plan.lengths`; `M` for requests that ignore
end-of-sequence), the output seen so far (`on_tokens`) and `ovh`
(`reservation_overhead_tokens`, KV block rounding). A sample tells the engine's *used* KV
tokens; it contains a request's footprint once the request was prefilled before the sample
was taken. So each hold also keeps

    reflected = 0                              until a sample taken at least
                                               `reflect_margin_s` after its first token;
                P + output known by the        afterwards (never lowered)
                sample's time

and a node's usage is known in two forms, both O(1) from running sums:

    now    = used + sum(P + output_so_far + ovh - reflected)   what it holds at this moment
    bound  = used + sum(P + M + ovh - reflected)                if everything ran to its cap
                                                                and nothing ended

`now` drives the node's watermark level (a node at panic on it takes nothing new). `bound`
is the fast path of admission: a newcomer that fits under a ceiling on `bound` fits for
sure. Otherwise the node's *envelope* decides (`kvgate.core.plan.envelope`): base `now`, and each
hold running `R = E - output_so_far` more steps (`M - output_so_far` once it outlived `E`),
holding `P + output_so_far + ovh`; a newcomer fits when the envelope's peak with it stays
under the ceiling. Reserving `M` for a request's whole life leaves KV idle that nobody will
use; the envelope counts that room back as each request's end comes into view.

Before the first token a hold counts its whole estimated prompt on top of the sample, which
over-counts a prefill in progress: a little lost room for one sample period, never too
little. A ticket released before the next sample drops its hold at once; its reflected
blocks, still in the last sample's `used`, count as freed (`freed_unseen`) only when that
sample arrived `FREED_MARGIN_S` before the release: the engine frees a request a little
before the gateway reads its end, and a sample rendered in between no longer contains it
(counting it freed again would under-count the node by a whole request until the next
sample). `sampled_at` should be the time
the scrape was *sent* (the engine renders its page after it); `reflect_margin_s` covers the
engine's gauge lag and the scrape's own latency.

Reflection is incremental, with the same result as re-walking every live hold at every
sample: a hold's `reflected` can only change when the sample's cutoff passes one of its
instants (its first token and its token-count checkpoints: counts arrive with every streamed
event, so a checkpoint is kept only every third of the margin, the last five), so each hold
is queued on its
node under the next such instant and a sample recomputes only the holds whose instant its
cutoff has reached: O(changed holds) per sample. The policy therefore learns of a first
token or a count only through `on_first_token`/`on_tokens`, not from a ticket's fields.

Limits, said plainly: a request the engine preempts loses its blocks while we count it as
reflected (under-counting; preemption happens only at exhaustion, which the thrashing
detector turns into "no new requests to this node"). Requests sent with no `max_tokens` are
capped at `default_max_tokens`; the shell writes that cap into the upstream body. Engines
without a KV gauge (llama.cpp, TGI): nothing is ever reflected, so the node's usage is the
sum of its holds against the capacity its backend entry configures (`kv_capacity_tokens`);
with none, such a node is gated by its queue (`waiting > 0` means full) and thrashing.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvgate.core.admission import Admit, Decision, Outcome, Reject, StartEstimate, Ticket
from kvgate.core.clock import Clock
from kvgate.core.nodes import NodeState, next_level
from kvgate.core.plan.envelope import Envelope
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.rates import DecayingRate, Ewma
from kvgate.core.replicas.peers import PeerState
from kvgate.core.request import AdmissionRequest
from kvgate.core.retry_after import MAX_RETRY_AFTER_S, jittered, retry_after
from kvgate.core.settings import AdmissionSettings
from kvgate.core.signals import NodeSample

_NEG_INF = float("-inf")
# The engine frees a request's blocks at most this long before the gateway reads its end
# (the final chunk's relay, which adds 3-4 ms at p99: benchmarks/proxy_overhead); a sample
# that arrived within it may already lack them.
FREED_MARGIN_S = 0.02
# Token-count checkpoints kept per request, at least a third of `reflect_margin_s` apart, so
# a sample's cutoff (its time less the margin) always finds one however often counts come.
_MARKS = 5
# How fast requests progress on a node is measured over this half-life: long enough that a
# long prompt's prefill, which slows every decode for seconds, counts at its share of time.
PACE_HALFLIFE_S = 10.0
_PACE_MIN = 8  # measurements before the pace is trusted
# Seconds per token assumed for a node before anything measured it (no stream has run on
# it and its samples report no iteration latency: a fresh gateway, an idle engine). An
# optimistic prior on purpose: a prediction made on a guess should queue a request rather
# than refuse it; once requests run, their measured pace replaces it, and a waiter whose
# wait then cannot be met is refused with the measured prediction.
DEFAULT_STEP_S = 0.01


class _Hold:
    """The policy's private record of one live ticket.

    `cut` is the cutoff at which `reflected` was last recomputed; `wake_at` the instant
    under which the hold is queued for its next recomputation (None: not queued, because
    nothing a later sample can show would change it); `live` is False once released.
    """

    __slots__ = (
        "cut",
        "expected",
        "full",
        "key",
        "live",
        "marks",
        "max_out",
        "node_id",
        "overlap",
        "prefilled",
        "prompt",
        "reflected",
        "ticket",
        "tok_cur",
        "wake_at",
    )

    def __init__(
        self, key: str, ticket: Ticket, node_id: str, prompt: int, max_out: int, overhead: int
    ) -> None:
        self.key = key
        self.ticket = ticket
        self.node_id = node_id
        self.prompt = prompt
        self.max_out = max_out
        self.expected = ticket.expected_output
        self.full = prompt + max_out + overhead
        self.reflected = 0
        self.prefilled = False  # its first token came: its prompt is no longer queued
        self.overlap = 0.0  # its part of the node's `unseen_overlap` at the last sample
        self.tok_cur = 0  # output tokens seen so far
        # (time, output count) checkpoints, oldest first, at least `_mark_spacing` apart:
        # what a sample taken at some cutoff can be trusted to contain.
        self.marks: list[tuple[float, int]] = []
        self.cut = _NEG_INF
        self.wake_at: float | None = None
        self.live = True

    def known_by(self, cutoff: float) -> int:
        """Output tokens the request had certainly produced by `cutoff`."""
        for at, count in reversed(self.marks):
            if at <= cutoff:
                return count
        return 0

    def remaining(self) -> int:
        """Steps still expected: to `expected`, or to the cap once it outlived that."""
        done = self.tok_cur
        target = self.expected if done < self.expected else self.max_out
        return max(0, target - done)


class _Wakeups:
    """One node's holds queued under instants: a FIFO for instants that arrive in order
    (the common case: a count taken now) and a heap for the rest.

    Entries of released or re-queued holds are dropped when popped; a node whose samples
    never pop anything (no KV gauge) is compacted instead, so the queue stays O(live holds).
    """

    __slots__ = ("fifo", "heap")

    def __init__(self) -> None:
        self.fifo: deque[tuple[float, _Hold]] = deque()
        self.heap: list[tuple[float, int, _Hold]] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def compact(self) -> None:
        """Keep only the entries a sample would still act on."""
        self.fifo = deque(e for e in self.fifo if e[1].live and e[1].wake_at == e[0])
        self.heap = [e for e in self.heap if e[2].live and e[2].wake_at == e[0]]
        heapq.heapify(self.heap)


class _Book:
    """One node's live holds and their running sums."""

    __slots__ = (
        "full",
        "holds",
        "now",
        "overlap",
        "overlap_for",
        "prefill",
        "upper",
        "version",
        "wakeups",
    )

    def __init__(self) -> None:
        self.holds: dict[str, _Hold] = {}
        self.full = 0  # sum of P + M + ovh
        self.upper = 0  # sum of P + M + ovh - reflected
        self.now = 0  # sum of P + output so far + ovh - reflected
        self.prefill = 0  # prompt tokens of the holds still waiting for their first token
        # `unseen_overlap` as of the sample taken at `overlap_for` (None: not computed).
        self.overlap = 0.0
        self.overlap_for: float | None = None
        self.wakeups = _Wakeups()
        self.version = 0


class BasePolicy:
    """Shared machinery; subclasses implement `_decide` (and optionally the hooks)."""

    name = "base"

    def __init__(
        self,
        settings: AdmissionSettings,
        clock: Clock,
        *,
        rng_seed: int | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        self.settings = settings
        self.tuning = settings.tuning
        self.clock = clock
        # Routing and jitter draw from here: seeded by the simulator and the benchmarks, so
        # that a run reproduces; a gateway passes None and draws OS entropy once, here.
        self.rng = random.Random(rng_seed)
        self.lengths = lengths if lengths is not None else OutputLengths()
        self.nodes: dict[str, NodeState] = {}
        self._holds: dict[str, _Hold] = {}
        self._books: dict[str, _Book] = {}
        self._wake_seq = itertools.count()
        self._seq = itertools.count()
        self._in_flight_tokens = 0
        self._freed = DecayingRate(self.tuning.release_rate_halflife_s)
        self._rr = 0
        self._mark_spacing = self.tuning.reflect_margin_s / 3
        self._paces: dict[str, Ewma] = {}  # seconds per token of each node's streams
        # Other replicas (kvgate.core.replicas.peers): their requests and claims; this replica's
        # published claim on each node's slack and what it may still add (both spent by
        # every start until the next sync).
        self.peers = PeerState()
        self._peers_version = 0
        self._claims: dict[str, float] = {}
        self._allowance: dict[str, float] = {}
        self._envelopes: dict[str, tuple[tuple[int, int], Envelope]] = {}
        self._drain_cache: tuple[int, tuple[str, ...], list[float], list[float]] | None = None
        # Bumped whenever anything a decision depends on changes (sample, ticket, node set),
        # so a policy may cache a "nothing fits" scan until the next change.
        self.generation = 0

    # --- the AdmissionPolicy contract ------------------------------------------------------

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        now = self.clock.now()
        if not request.candidates:
            return self._reject_unavailable(
                "no_backend", "No backend serves this model.", now, retry_s=1.0
            )
        expected = self.lengths.expected(
            request.model, request.cost.max_output_tokens, request.exact_output
        )
        choice = self._decide(now, request, expected, promised or {})
        if isinstance(choice, Reject):
            return choice
        return Admit(self._open(now, request, choice, expected))

    def start_estimate(self, request: AdmissionRequest) -> StartEstimate | None:
        return None

    def shortfall(self, request: AdmissionRequest) -> float:
        """Tokens the candidates must free before `request` fits on the best of them (its
        own size when nothing more precise is known)."""
        return float(request.cost.total)

    def drain_time(self, tokens: float, candidates: Sequence[str]) -> float | None:
        """When the candidates will have freed `tokens`: from the envelope's ends (each
        hold frees its final footprint after its remaining steps), extrapolated past the
        last end at the average rate of those ends; else from the measured freeing rate."""
        if tokens <= 0:
            return 0.0
        times, freed = self._drain_schedule(tuple(candidates))
        if times:
            i = bisect.bisect_left(freed, tokens)
            if i < len(times):
                return times[i]
            last = max(times[-1], 1e-3)
            return last + (tokens - freed[-1]) / (freed[-1] / last)
        rate = self.freed_tokens_per_s(self.clock.now())
        return tokens / rate if rate > 0 else None

    def _drain_schedule(self, candidates: tuple[str, ...]) -> tuple[list[float], list[float]]:
        """(end times, tokens freed by then) of the candidates' holds, this replica's and the
        others' (as of the last sync), cached until anything changes."""
        cached = self._drain_cache
        if cached is not None and cached[0] == self.generation and cached[1] == candidates:
            return cached[2], cached[3]
        ends: list[tuple[float, float]] = []
        for node_id in candidates:
            book = self._books.get(node_id)
            peers = self.peers.nodes.get(node_id)
            if not book and peers is None:
                continue
            step = self.step_s(node_id)
            for hold in book.holds.values() if book else ():
                remaining = hold.remaining()
                ends.append((remaining * step, self._current(hold) + remaining))
            for steps, held in () if peers is None else peers.loads:
                ends.append((steps * step, held + steps))  # other replicas' requests
        ends.sort()
        times = [at for at, _ in ends]
        freed = list(itertools.accumulate(amount for _, amount in ends))
        self._drain_cache = (self.generation, candidates, times, freed)
        return times, freed

    def time_left(self, ticket: Ticket) -> float:
        """Seconds until the ticket's request is expected to end (0 once released)."""
        hold = self._holds.get(ticket.key)
        if hold is None:
            return 0.0
        return hold.remaining() * self.step_s(hold.node_id)

    def on_first_token(self, ticket: Ticket) -> None:
        if ticket.first_token_at is None:
            ticket.first_token_at = self.clock.now()
        hold = self._holds.get(ticket.key)
        if hold is not None:
            self._prefilled(hold)
            self._progress(hold.node_id, ticket.first_token_at)
            self._schedule(hold, ticket.first_token_at)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        now = self.clock.now()
        hold = self._holds.get(ticket.key)
        if ticket.first_token_at is None:
            ticket.first_token_at = now
            if hold is not None:
                self._prefilled(hold)
                self._schedule(hold, now)
        if hold is None or output_tokens <= hold.tok_cur:
            return
        self._progress(hold.node_id, now)
        output_tokens = min(output_tokens, hold.max_out)  # past it: stream framing, no KV
        if output_tokens <= hold.tok_cur:
            return
        ticket.output_tokens = output_tokens
        book = self._books[hold.node_id]
        grown = output_tokens - hold.tok_cur
        book.now += grown
        self._progressed(hold, book, grown, output_tokens)
        hold.tok_cur = output_tokens
        marks = hold.marks
        if not marks or now - marks[-1][0] >= self._mark_spacing:
            if marks and output_tokens > marks[-1][1]:
                at, count = marks[-1]
                self._stream_pace(hold.node_id).update(now, (now - at) / (output_tokens - count))
            marks.append((now, output_tokens))
            if len(marks) > _MARKS:
                del marks[0]
            self._schedule(hold, now)

    def _progressed(self, hold: _Hold, book: _Book, grown: int, output_tokens: int) -> None:
        """Keep the node's cached envelope safe as a request grows by `grown` tokens.

        An envelope of the same requests taken before they progressed, with its base raised
        by what they grew, counts every growth still to come from the older point and frees
        less at each end: it can only plan a higher peak, so it stays usable. Not so when a
        request passes its expected length: from then on it is planned to its cap, a longer
        future the cached envelope does not have, so it is rebuilt."""
        cached = self._envelopes.get(hold.node_id)
        if cached is None or cached[0] != (book.version, self._peers_version):
            return
        if hold.tok_cur < hold.expected <= output_tokens and hold.expected < hold.max_out:
            book.version += 1
        else:
            cached[1].base += grown

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        if ticket.released:
            return
        ticket.released = True
        hold = self._holds.pop(ticket.key, None)
        if hold is None:
            return
        hold.live = False
        book = self._books[hold.node_id]
        del book.holds[hold.key]
        book.overlap -= hold.overlap
        book.full -= hold.full
        book.upper -= hold.full - hold.reflected
        book.now -= self._current(hold) - hold.reflected
        if not hold.prefilled:
            book.prefill -= hold.prompt
        book.version += 1
        if not book.holds:
            del self._books[hold.node_id]  # its wake-up queue held only dead holds
            self._envelopes.pop(hold.node_id, None)  # a new book counts its versions anew
        self._in_flight_tokens -= hold.full
        self.generation += 1
        now = self.clock.now()
        node = self.nodes.get(hold.node_id)
        if node is not None and node.heard_at <= now - FREED_MARGIN_S:
            # The engine freed the blocks a little before this release: only a sample that
            # arrived a margin earlier surely still holds them (else they are freed twice).
            node.freed_unseen += hold.reflected
        self._refresh_level(hold.node_id)
        self._freed.add(now, hold.full)
        if outcome is Outcome.DONE:
            request = ticket.request
            produced = max(ticket.output_tokens, hold.tok_cur)
            self.lengths.learn(request.model, request.cost.max_output_tokens, produced)
        self._on_release(now, hold, outcome)

    def observe(self, node_id: str, sample: NodeSample) -> None:
        now = self.clock.now()
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        self._before_observe(node)
        if not node.accept(sample, now, self.settings):
            return
        self.generation += 1
        self._envelopes.pop(node_id, None)  # its base is the sample's `used`
        book = self._books.get(node_id)
        if book is not None:
            book.version += 1
            self._reflect(book, sample)
        self._refresh_level(node_id)
        self._on_observe(now, node)

    def observe_failure(self, node_id: str, hard: bool = True) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        node.fail(hard)
        self.generation += 1

    def add_node(self, node_id: str) -> None:
        if node_id not in self.nodes:
            self.nodes[node_id] = NodeState(node_id)
            self.generation += 1

    def remove_node(self, node_id: str) -> None:
        """Forget the node's state; its live tickets stay held until the shell releases them."""
        self.nodes.pop(node_id, None)
        self._paces.pop(node_id, None)
        self._envelopes.pop(node_id, None)
        self.generation += 1

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.now()
        return {
            "policy": self.name,
            "time": now,
            "nodes": {nid: self._node_snapshot(now, node) for nid, node in self.nodes.items()},
            "controller": self._controller_snapshot(now),
            "in_flight_requests": len(self._holds),
            "released_tokens_per_s": self._freed.value(now),
            "expected_output": self.lengths.snapshot(),
        }

    # --- for subclasses ---------------------------------------------------------------------

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        raise NotImplementedError

    def _before_observe(self, node: NodeState) -> None:
        """Called before a new sample of the node is taken (the last plan still stands)."""

    def _on_observe(self, now: float, node: NodeState) -> None:
        """Called after a new sample was accepted and reflected."""

    def _on_release(self, now: float, hold: _Hold, outcome: Outcome) -> None:
        """Called once per released ticket."""

    def _controller_snapshot(self, now: float) -> dict[str, Any]:
        return {
            "in_flight_tokens": self._in_flight_tokens,
            "high_watermark": self.settings.high_watermark,
            "panic_watermark": self.settings.panic_watermark,
        }

    # --- helpers ------------------------------------------------------------------------------

    @property
    def in_flight_requests(self) -> int:
        return len(self._holds)

    @property
    def in_flight_tokens(self) -> int:
        return self._in_flight_tokens

    def in_flight_on(self, node_id: str) -> int:
        book = self._books.get(node_id)
        return len(book.holds) if book else 0

    def reserved_on(self, node_id: str) -> int:
        """What the node's last sample cannot contain of its holds at their caps."""
        book = self._books.get(node_id)
        return book.upper if book else 0

    def unreflected_now(self, node_id: str) -> int:
        """What the node's last sample cannot contain of its holds as they are now."""
        book = self._books.get(node_id)
        return book.now if book else 0

    def freed_tokens_per_s(self, now: float) -> float:
        return self._freed.value(now)

    def footprint(self, request: AdmissionRequest, expected: int) -> int:
        """Tokens the request will hold at its end if it runs as expected."""
        return request.cost.prompt_tokens + expected + self.tuning.reservation_overhead_tokens

    def step_s(self, node_id: str) -> float:
        """Seconds per token of a request running on the node: measured on its streams
        (prefill steps that interrupt decoding included, averaged over `PACE_HALFLIFE_S`),
        else from its samples' iteration latency, else a default."""
        pace = self._paces.get(node_id)
        if pace is not None and pace.value is not None and pace.count >= _PACE_MIN:
            return pace.value
        node = self.nodes.get(node_id)
        step = None if node is None else node.step_s
        return step if step is not None and step > 0 else DEFAULT_STEP_S

    def _stream_pace(self, node_id: str) -> Ewma:
        pace = self._paces.get(node_id)
        if pace is None:
            pace = self._paces[node_id] = Ewma(PACE_HALFLIFE_S)
        return pace

    def fastest_step_s(self, node_id: str) -> float:
        """The node's healthy step time (its latency baseline) when lower than the recent."""
        step = self.step_s(node_id)
        node = self.nodes.get(node_id)
        baseline = (
            None if node is None or node.latency_baseline is None else node.latency_baseline.value
        )
        if baseline is not None and 0 < baseline < step:
            return baseline
        return step

    def now_tokens(self, node: NodeState) -> float | None:
        """`now`: reported used tokens plus what the sample cannot contain yet."""
        if node.cap is None:
            return None
        return node.used + self.unreflected_now(node.node_id)

    def usage_now(self, node: NodeState) -> float | None:
        """What the node holds now as a fraction of its capacity (the panic gate's measure:
        `now` less what the sample most likely holds twice)."""
        capacity = node.capacity(self.settings)
        tokens = self.now_tokens(node)
        if capacity is None or tokens is None:
            return None
        return (tokens - self.unseen_overlap(node)) / capacity

    def envelope(self, node: NodeState) -> Envelope:
        """The node's envelope (see the module docstring), cached until its book or the
        peers change: this replica's holds, other replicas' (kvgate.core.replicas.peers), and what
        ended since the last sample (still in `used` but already free: a load that ends
        now, not a lasting part of the base)."""
        node_id = node.node_id
        book = self._books.get(node_id)
        key = (-1 if book is None else book.version, self._peers_version)
        cached = self._envelopes.get(node_id)
        if cached is not None and cached[0] == key and not node.freed_unseen:
            return cached[1]
        overhead = self.tuning.reservation_overhead_tokens
        loads: list[tuple[float, float]] = []
        base = node.used
        if book is not None:
            loads = [(h.remaining(), h.prompt + h.tok_cur + overhead) for h in book.holds.values()]
            base += book.now
        peers = self.peers.nodes.get(node_id)
        if peers is not None:
            loads.extend(peers.loads)
            base += peers.unreflected
        if node.freed_unseen:
            loads.append((0, node.freed_unseen))
        env = Envelope(base, loads)
        if not node.freed_unseen:
            self._envelopes[node_id] = (key, env)
        return env

    def own_envelope(self, node_id: str) -> Envelope:
        """This replica's requests alone, from zero (for its static share when isolated)."""
        book = self._books.get(node_id)
        if book is None:
            return Envelope(0.0)
        overhead = self.tuning.reservation_overhead_tokens
        loads = [(h.remaining(), h.prompt + h.tok_cur + overhead) for h in book.holds.values()]
        return Envelope(sum(c for _, c in loads), loads)

    def peers_upper(self, node_id: str) -> float:
        """Other replicas' requests on the node if all grew to their end and none ended."""
        peers = self.peers.nodes.get(node_id)
        return 0.0 if peers is None else peers.upper

    def allowance(self, node_id: str) -> float | None:
        """Tokens (final footprints) this replica may still add to the node before the next
        sync; None when it is alone (no peers, not isolated)."""
        return self._allowance.get(node_id)

    def claim(self, share: Callable[[str, float], float]) -> dict[str, float]:
        """This replica's claims, to publish now: `share(node, slack)` of each node's slack
        (its panic ceiling less its planned peak). What it may add before its next sync
        can only shrink to the claim, since the others plan around the claim from now on."""
        claims: dict[str, float] = {}
        for node_id in self.nodes:
            slack = self.slack(node_id)
            claims[node_id] = share(node_id, slack) * slack
            left = self._allowance.get(node_id)
            if left is not None:
                self._allowance[node_id] = min(left, claims[node_id])
        self._claims = claims
        return {n: round(c, 1) for n, c in claims.items()}

    def set_peers(self, state: PeerState) -> None:
        """Take the other replicas' state (their holds and claims) from an exchange that
        published this replica's last `claim()`: until the next one it may add to a node
        what is left of its claim, and only what the others' claims leave of the slack;
        isolated, the node's room is split statically instead (see `kvgate.core.replicas.peers`)."""
        self.peers = state
        self._peers_version += 1
        self.generation += 1
        self._allowance = {}
        if state.isolated or state.members <= 1:
            self._claims = {}
            return
        for node_id in self.nodes:
            peers = state.nodes.get(node_id)
            free = self.slack(node_id) - (0.0 if peers is None else peers.claimed)
            self._allowance[node_id] = max(0.0, min(self._claims.get(node_id, 0.0), free))

    def local_holds(self) -> dict[str, list[list[float]]]:
        """This replica's requests per node as `[unreflected, held, remaining, age]` (age:
        seconds since the request was sent to the engine)."""
        overhead = self.tuning.reservation_overhead_tokens
        now = self.clock.now()
        out: dict[str, list[list[float]]] = {}
        for node_id, book in self._books.items():
            out[node_id] = [
                [
                    h.prompt + h.tok_cur + overhead - h.reflected,
                    h.prompt + h.tok_cur + overhead,
                    h.remaining(),
                    round(now - h.ticket.admitted_at, 3),
                ]
                for h in book.holds.values()
            ]
        return out

    def slack(self, node_id: str) -> float:
        node = self.nodes.get(node_id)
        if node is None or node.cap is None:
            return 0.0
        return max(0.0, self.settings.panic_watermark * node.cap - self.envelope(node).peak())

    def unseen_overlap(self, node: NodeState) -> float:
        """Tokens the node's last sample most likely holds twice: this replica's requests'
        (`own_overlap`) and the other replicas' (as their views said at the last sync)."""
        peers = self.peers.nodes.get(node.node_id)
        own = self.own_overlap(node)
        if peers is None or not peers.unseen or node.sample is None:
            return own
        at = node.sample.sampled_at
        return own + sum(tokens for sent, tokens in peers.unseen if sent < at)

    def own_overlap(self, node: NodeState) -> float:
        """Tokens the node's last sample most likely holds twice for this replica.

        A hold counts in full until a sample taken `reflect_margin_s` after its first token
        confirms its prompt; a long prompt's prefill can take seconds, during which the
        engine's `used` grows with it while the hold still counts it whole. Here every hold
        sent before the sample was taken is taken to be in it (an engine with room takes a
        prompt's blocks when the request arrives): its prompt, and the output it had made
        by then. Admission keeps the over-count (it is the safe error); the panic gate and
        the predictions of when room frees subtract it, or a node in the middle of a long
        prefill would look fuller than it can ever be, and a request that will fit once
        what runs has ended would be refused as one that never fits."""
        book = self._books.get(node.node_id)
        sample = node.sample
        if book is None or sample is None or sample.kv_usage is None:
            return 0.0  # (a sample without a KV gauge holds none of it)
        at = sample.sampled_at
        if book.overlap_for == at:
            return book.overlap  # once per sample; a release takes its own part out
        overlap = 0.0
        for hold in book.holds.values():
            part = 0.0
            if hold.ticket.admitted_at < at:
                likely = hold.prompt + hold.known_by(at)
                if likely > hold.reflected:
                    part = likely - hold.reflected
            hold.overlap = part
            overlap += part
        book.overlap, book.overlap_for = overlap, at
        return overlap

    def least_loaded(self, candidates: Sequence[str]) -> str:
        """Fewest live tickets; ties broken round-robin so equal nodes share the load.

        From `p2c_min_nodes` candidates on: the less loaded of two random ones (O(1)).
        """
        n = len(candidates)
        if n >= self.tuning.p2c_min_nodes:
            i = self.rng.randrange(n)
            j = self.rng.randrange(n - 1)
            a, b = candidates[i], candidates[j + (j >= i)]
            return a if self.in_flight_on(a) <= self.in_flight_on(b) else b
        self._rr = (self._rr + 1) % n
        best = candidates[self._rr]
        best_load = self.in_flight_on(best)
        for i in range(1, n):
            cand = candidates[(self._rr + i) % n]
            load = self.in_flight_on(cand)
            if load < best_load:
                best, best_load = cand, load
        return best

    def reject_shed(
        self, reason: str, message: str, now: float, excess_tokens: float, waitable: bool = False
    ) -> Reject:
        """429: shed now, come back after the cluster has freed `excess_tokens`."""
        delay = retry_after(excess_tokens, self._freed.value(now), MAX_RETRY_AFTER_S, self.rng)
        return Reject(429, reason, delay, message, waitable)

    def _reject_unavailable(
        self, reason: str, message: str, now: float, retry_s: float | None = None
    ) -> Reject:
        """503: no backend can serve at all; retry after about one staleness period."""
        centre = retry_s if retry_s is not None else max(1.0, self.settings.stale_after_s)
        centre = min(max(1.0, centre), MAX_RETRY_AFTER_S)
        delay = jittered(centre, self.rng, MAX_RETRY_AFTER_S)
        return Reject(status=503, reason=reason, retry_after_s=delay, message=message)

    def _open(self, now: float, request: AdmissionRequest, node_id: str, expected: int) -> Ticket:
        key = f"{next(self._seq)}:{request.request_id}"
        ticket = Ticket(
            request=request, node_id=node_id, admitted_at=now, key=key, expected_output=expected
        )
        overhead = self.tuning.reservation_overhead_tokens
        cost = request.cost
        hold = _Hold(key, ticket, node_id, cost.prompt_tokens, cost.max_output_tokens, overhead)
        self._holds[key] = hold
        book = self._books.get(node_id)
        if book is None:
            book = self._books[node_id] = _Book()
        book.holds[key] = hold
        book.full += hold.full
        book.upper += hold.full
        held = hold.prompt + overhead
        book.now += held
        book.prefill += hold.prompt
        cached = self._envelopes.get(node_id)
        version = (book.version, self._peers_version)
        book.version += 1
        if cached is not None and cached[0] == version:
            cached[1].add(held, hold.remaining())  # keep the cache: O(n) insert, no re-sort
            self._envelopes[node_id] = ((book.version, self._peers_version), cached[1])
        if node_id in self._allowance:
            footprint = self.footprint(request, expected)
            self._allowance[node_id] -= footprint
            if node_id in self._claims:
                self._claims[node_id] -= footprint
        self._in_flight_tokens += hold.full
        self.generation += 1
        self._refresh_level(node_id)
        return ticket

    def _prefilled(self, hold: _Hold) -> None:
        if not hold.prefilled:
            hold.prefilled = True
            self._books[hold.node_id].prefill -= hold.prompt

    def prefill_backlog(self, node_id: str) -> int:
        """Prompt tokens sent to the node that have not produced a first token yet: what a
        newcomer's own prefill waits behind in the engine."""
        book = self._books.get(node_id)
        return book.prefill if book else 0

    def _progress(self, node_id: str, now: float) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.progress(now)

    def _current(self, hold: _Hold) -> int:
        return hold.prompt + hold.tok_cur + self.tuning.reservation_overhead_tokens

    def _reflect(self, book: _Book, sample: NodeSample) -> None:
        """Lower each live hold by what this sample already contains.

        For each live hold whose first token came at least `reflect_margin_s` before the
        sample: reflected = prompt + output known by then, never lowered, at most the full
        footprint less the overhead. Only the holds queued under an instant this cutoff has
        reached are recomputed; every other hold would come out unchanged.
        """
        if sample.kv_usage is None:
            return
        cutoff = sample.sampled_at - self.tuning.reflect_margin_s
        overhead = self.tuning.reservation_overhead_tokens
        queued = book.wakeups
        fifo, heap = queued.fifo, queued.heap
        popleft = fifo.popleft
        while fifo and fifo[0][0] <= cutoff:
            at, hold = popleft()
            if hold.live and hold.wake_at == at:  # else released, or queued again since
                self._reflect_hold(book, hold, cutoff, overhead)
        while heap and heap[0][0] <= cutoff:
            at, _, hold = heapq.heappop(heap)
            if hold.live and hold.wake_at == at:
                self._reflect_hold(book, hold, cutoff, overhead)

    def _reflect_hold(self, book: _Book, hold: _Hold, cutoff: float, overhead: int) -> None:
        """The walk's formula for one hold at one cutoff; re-queue it unless settled."""
        hold.wake_at = None
        ticket = hold.ticket
        first = ticket.first_token_at
        if first is not None and first <= cutoff:
            reflected = hold.prompt + hold.known_by(cutoff)
            if reflected < hold.reflected:
                reflected = hold.reflected
            most = hold.full - overhead
            if reflected > most:
                reflected = most
            delta = reflected - hold.reflected
            if delta:
                hold.reflected = reflected
                book.upper -= delta
                book.now -= delta
        hold.cut = cutoff
        marks = hold.marks
        if first is None or first > cutoff or (marks and marks[-1][0] > cutoff):
            self._schedule(hold)  # else settled: every instant is at or before the cutoff

    def _schedule(self, hold: _Hold, touched_at: float | None = None) -> None:
        """Queue `hold` under the next instant at which a sample could change its reflection.

        From its last recomputation's cutoff (`cut`) up to the next of its instants (first
        token and its count checkpoints) after `cut`, what a sample reflects
        of it is constant, so no sample before that instant needs to look at it; with no
        such instant it is settled. `touched_at` is the instant `on_first_token`/`on_tokens`
        just wrote: if it is not after `cut` (a zero margin, a count taken at the cutoff's
        very time) the next sample looks. A fully reflected hold never changes again.
        """
        if hold.reflected >= hold.full - self.tuning.reservation_overhead_tokens:
            return
        first = hold.ticket.first_token_at
        if first is None:
            return  # nothing to reflect before a first token; on_first_token queues it
        cut = hold.cut
        wake: float | None
        if touched_at is not None and touched_at <= cut:
            wake = cut
        else:
            wake = None
            for at, _ in hold.marks:  # the earliest checkpoint after `cut`
                if at > cut:
                    wake = at
                    break
            if first > cut and (wake is None or first < wake):
                wake = first
            if wake is None:
                return  # settled until on_tokens changes it
        queued = hold.wake_at
        if queued is not None and queued <= wake:
            return  # already queued no later than needed; that look re-queues it
        hold.wake_at = wake
        book = self._books[hold.node_id]
        queue = book.wakeups
        fifo = queue.fifo
        if not fifo or fifo[-1][0] <= wake:
            fifo.append((wake, hold))
        else:
            heapq.heappush(queue.heap, (wake, next(self._wake_seq), hold))
        if len(fifo) + len(queue.heap) > 2 * len(book.holds) + 64:
            queue.compact()  # amortised O(1): at least half of it was dead

    def _refresh_level(self, node_id: str) -> None:
        """Move the node's watermark state (with hysteresis) after its usage changed."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        usage = self.usage_now(node)
        if usage is None:
            return
        s = self.settings
        node.level = next_level(
            node.level, usage, s.high_watermark, s.panic_watermark, self.tuning.hysteresis
        )

    def _node_snapshot(self, now: float, node: NodeState) -> dict[str, Any]:
        entry = node.snapshot(now, self.settings)
        entry["reserved_tokens"] = self.reserved_on(node.node_id)
        entry["in_flight"] = self.in_flight_on(node.node_id)
        entry["predicted_usage"] = self.usage_now(node)
        return entry
