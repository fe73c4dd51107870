"""Holds: what a policy counts for each admitted request, and their reflection in samples.

A request's KV footprint grows from its prompt (after prefill) to prompt + output. For each
live ticket the policy keeps a *hold* (`Hold`): the prompt `P` (estimated), the output cap
`M`, the expected output `E` (learned, see `kvgate.core.plan.lengths`; `M` for requests
that ignore end-of-sequence), the output seen so far (`Holds.grow`) and `ovh`
(`reservation_overhead_tokens`, KV block rounding). A sample tells the engine's *used* KV
tokens; it contains a request's footprint once the request was prefilled before the sample
was taken. So each hold also keeps

    reflected = 0                              until a sample taken at least
                                               `reflect_margin_s` after its first token;
                P + output known by the        afterwards (never lowered)
                sample's time

and a node's usage is known in two forms, both O(1) from running sums (`Book`):

    now    = used + sum(P + output_so_far + ovh - reflected)   what it holds at this moment
    bound  = used + sum(P + M + ovh - reflected)                if everything ran to its cap
                                                                and nothing ended

`now` drives the node's watermark level (a node at panic on it takes nothing new). `bound`
is the fast path of admission: a newcomer that fits under a ceiling on `bound` fits for
sure; otherwise the node's envelope decides (`kvgate.core.plan.forecast`).

Before the first token a hold counts its whole estimated prompt on top of the sample, which
over-counts a prefill in progress: a little lost room for one sample period, never too
little. A ticket released drops its hold at once; its reflected blocks are a load that ends
now (`NodeState.freed_unseen`) until the next sample. The engine frees a request a little
before the gateway reads its end, so the last sample may or may not still hold them; and a
sample rendered after the engine ended a request whose end the gateway has not read yet
lacks blocks the hold says it contains. The forecast never takes a sample to hold less than
the reflected parts of the live holds and of those released since it (`Holds.reflected_on`,
`Forecast.used`), so a request's blocks are freed once, never twice. `sampled_at` should be the
time the scrape was *sent* (the engine renders
its page after it); `reflect_margin_s` covers the engine's gauge lag and the scrape's own
latency. `Holds.overlap` is the other side of that over-count: what the last sample most
likely holds twice (every hold sent before it, its prompt and the output it had made).

Reflection is incremental, with the same result as re-walking every live hold at every
sample: a hold's `reflected` can only change when the sample's cutoff passes one of its
instants (its first token and its token-count checkpoints: counts arrive with every streamed
event, so a checkpoint is kept only every third of the margin, the last five), so each hold
is queued on its node (`Wakeups`) under the next such instant and a sample recomputes only
the holds whose instant its cutoff has reached: O(changed holds) per sample. The policy
therefore learns of a first token or a count only through `first_token`/`grow`, not from a
ticket's fields.

Limits, said plainly: a request the engine preempts loses its blocks while we count it as
reflected (under-counting; preemption happens only at exhaustion, which the thrashing
detector turns into "no new requests to this node"). A request sent with no `max_tokens` is
capped at the rest of the model's context (what the engine stops at), or, where that is
unknown, at `default_max_tokens`, which the shell writes into the upstream body. Engines
without a KV gauge (llama.cpp, TGI): nothing is ever reflected, so the node's usage is the
sum of its holds against the capacity its backend entry configures (`kv_capacity_tokens`);
with none, such a node is gated by its queue (`waiting > 0` means full) and thrashing.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from kvgate.core.admission import Ticket
from kvgate.core.settings import Tuning
from kvgate.core.signals import NodeSample

_NEG_INF = float("-inf")
# Token-count checkpoints kept per request, at least a third of `reflect_margin_s` apart, so
# a sample's cutoff (its time less the margin) always finds one however often counts come.
_MARKS = 5


class Hold:
    """The policy's private record of one live ticket.

    `cut` is the cutoff at which `reflected` was last recomputed; `wake_at` the instant
    under which the hold is queued for its next recomputation (None: not queued, because
    nothing a later sample can show would change it); `live` is False once released.
    """

    __slots__ = (
        "cut",
        "expected",
        "full",
        "guessed",
        "key",
        "likely",
        "live",
        "marks",
        "max_out",
        "node_id",
        "overlap",
        "prefilled",
        "prompt",
        "queued",
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
        self.queued = prompt  # prompt tokens the engine must prefill (its cache aside)
        self.max_out = max_out
        self.expected = ticket.expected_output
        # Its expected length is the cap only because its model's lengths are unknown yet
        # (`OutputLengths.informed`): when it ends is a guess, not a prediction.
        self.guessed = False
        self.likely = self.expected  # its most likely length (`OutputLengths.likely`)
        self.full = prompt + max_out + overhead
        self.reflected = 0
        self.prefilled = False  # its first token came: its prompt is no longer queued
        self.overlap = 0.0  # its part of the node's `Holds.overlap` at the last sample
        self.tok_cur = 0  # output tokens seen so far
        # (time, output count) checkpoints, oldest first, at least `mark_spacing` apart:
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

    def likely_remaining(self) -> int:
        """Steps it most likely still runs: to its likely length while short of it, else
        as `remaining`."""
        done = self.tok_cur
        return self.likely - done if done < self.likely else self.remaining()


class Wakeups:
    """One node's holds queued under instants: a FIFO for instants that arrive in order
    (the common case: a count taken now) and a heap for the rest.

    Entries of released or re-queued holds are dropped when popped; a node whose samples
    never pop anything (no KV gauge) is compacted instead, so the queue stays O(live holds).
    """

    __slots__ = ("fifo", "heap")

    def __init__(self) -> None:
        self.fifo: deque[tuple[float, Hold]] = deque()
        self.heap: list[tuple[float, int, Hold]] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def compact(self) -> None:
        """Keep only the entries a sample would still act on."""
        self.fifo = deque(e for e in self.fifo if e[1].live and e[1].wake_at == e[0])
        self.heap = [e for e in self.heap if e[2].live and e[2].wake_at == e[0]]
        heapq.heapify(self.heap)


class Book:
    """One node's live holds and their running sums.

    `version` names the holds' state for the forecast's cached envelope
    (`kvgate.core.plan.forecast`), which bumps it whenever that envelope must be rebuilt.
    """

    __slots__ = (
        "full",
        "guessed",
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
        self.holds: dict[str, Hold] = {}
        self.full = 0  # sum of P + M + ovh
        self.upper = 0  # sum of P + M + ovh - reflected
        self.now = 0  # sum of P + output so far + ovh - reflected
        self.prefill = 0  # prompt tokens of the holds still waiting for their first token
        self.guessed = 0  # holds whose length is a guess (`Hold.guessed`)
        # `Holds.overlap` as of the sample taken at `overlap_for` (None: not computed).
        self.overlap = 0.0
        self.overlap_for: float | None = None
        self.wakeups = Wakeups()
        self.version = 0


class Holds:
    """Every live hold, by ticket key (`live`) and by node (`books`), and their reflection."""

    def __init__(self, tuning: Tuning) -> None:
        self.overhead = tuning.reservation_overhead_tokens
        self.reflect_margin_s = tuning.reflect_margin_s
        self.mark_spacing = tuning.reflect_margin_s / 3
        self.live: dict[str, Hold] = {}
        self.books: dict[str, Book] = {}
        self.tokens = 0  # P + M + ovh of every live hold
        self._wake_seq = itertools.count()

    # --- a hold's life ------------------------------------------------------------------------

    def open(
        self,
        ticket: Ticket,
        guessed: bool = False,
        likely: int | None = None,
        shared: int = 0,
        cached: int = 0,
    ) -> Hold:
        """Hold the admitted ticket's prompt (and, at its cap, its output) on its node, less
        the `shared` prompt tokens other holds there count already
        (`kvgate.core.prefix.held`); its prefill is what neither they nor the engine's
        cache (`cached` tokens, as the prefix index predicts) hold. `guessed`: its expected
        length is a guess (`Hold.guessed`); `likely`: its most likely length (its expected
        one when not given)."""
        cost = ticket.request.cost
        node_id = ticket.node_id
        key = ticket.key
        overhead = self.overhead
        prompt = cost.prompt_tokens - shared
        hold = Hold(key, ticket, node_id, prompt, cost.max_output_tokens, overhead)
        hold.queued = max(0, cost.prompt_tokens - max(shared, cached))
        hold.guessed = guessed
        if likely is not None:
            hold.likely = min(likely, hold.expected)
        self.live[key] = hold
        book = self.books.get(node_id)
        if book is None:
            book = self.books[node_id] = Book()
        book.holds[key] = hold
        book.full += hold.full
        book.upper += hold.full
        book.now += hold.prompt + overhead
        book.prefill += hold.queued
        book.guessed += guessed
        self.tokens += hold.full
        return hold

    def first_token(self, hold: Hold, at: float) -> None:
        """The request's first token came at `at`: its prompt is no longer queued, and a
        sample may start to reflect it."""
        self.prefilled(hold)
        self.schedule(hold, at)

    def prefilled(self, hold: Hold) -> None:
        if not hold.prefilled:
            hold.prefilled = True
            self.books[hold.node_id].prefill -= hold.queued

    def grow(self, hold: Hold, book: Book, output_tokens: int, now: float) -> float | None:
        """The request has produced `output_tokens` (more than it had) by `now`. Returns the
        seconds per token it took since its last checkpoint when a new one is taken (the
        node's pace, `kvgate.core.plan.pace`), else None."""
        book.now += output_tokens - hold.tok_cur
        hold.tok_cur = output_tokens
        marks = hold.marks
        if marks and now - marks[-1][0] < self.mark_spacing:
            return None
        pace = None
        if marks and output_tokens > marks[-1][1]:
            at, count = marks[-1]
            pace = (now - at) / (output_tokens - count)
        marks.append((now, output_tokens))
        if len(marks) > _MARKS:
            del marks[0]
        self.schedule(hold, now)
        return pace

    def transfer(self, source: Hold, heir: Hold, tokens: int) -> None:
        """Move `tokens` of shared prompt blocks from `source` (about to end) to `heir` (on
        the same node, expected to end later): they stay held, in the heir's prompt, and
        stay reflected in samples when they were. The node's sums do not change."""
        tokens = min(tokens, source.prompt)
        if tokens <= 0:
            return
        reflected = min(tokens, max(0, source.reflected - source.tok_cur), source.reflected)
        source.prompt -= tokens
        source.full -= tokens
        source.reflected -= reflected
        heir.prompt += tokens
        heir.full += tokens
        heir.reflected += reflected
        self.books[source.node_id].version += 1

    def recount(self, hold: Hold, before: int, prompt_tokens: int, shared: int) -> None:
        """The hold's prompt, opened as `before` tokens, was counted as `prompt_tokens`, of
        which other holds on its node count `shared` already: its footprint moves by the
        difference. A reflected hold counted its whole prompt as in the samples: that part
        moves with it (the samples show the prompt the engine holds). Its prefill, if still
        queued, keeps the part the engine's cache was expected to hold."""
        book = self.books[hold.node_id]
        delta = prompt_tokens - shared - hold.prompt
        hold.prompt += delta
        hold.full += delta
        self.tokens += delta
        book.full += delta
        book.upper += delta
        book.now += delta
        if hold.reflected > 0:
            shift = min(max(-hold.reflected, delta), hold.full - self.overhead - hold.reflected)
            hold.reflected += shift
            book.upper -= shift
            book.now -= shift
        if not hold.prefilled:
            cached = before - hold.queued
            queued = max(0, prompt_tokens - max(shared, cached))
            book.prefill += queued - hold.queued
            hold.queued = queued
        book.version += 1

    def release(self, key: str) -> Hold | None:
        """Drop the ticket's hold (None if it holds none); a node left without holds loses
        its book, whose wake-up queue held only dead holds."""
        hold = self.live.pop(key, None)
        if hold is None:
            return None
        hold.live = False
        book = self.books[hold.node_id]
        del book.holds[key]
        book.overlap -= hold.overlap
        book.full -= hold.full
        book.upper -= hold.full - hold.reflected
        book.now -= self.current(hold) - hold.reflected
        if not hold.prefilled:
            book.prefill -= hold.queued
        book.guessed -= hold.guessed
        if not book.holds:
            del self.books[hold.node_id]
        self.tokens -= hold.full
        return hold

    # --- what a node holds ------------------------------------------------------------------

    def current(self, hold: Hold) -> int:
        """The tokens the request holds now."""
        return hold.prompt + hold.tok_cur + self.overhead

    def in_flight_on(self, node_id: str) -> int:
        book = self.books.get(node_id)
        return len(book.holds) if book else 0

    def reserved_on(self, node_id: str) -> int:
        """What the node's last sample cannot contain of its holds at their caps."""
        book = self.books.get(node_id)
        return book.upper if book else 0

    def reflected_on(self, node_id: str) -> int:
        """What the node's last sample is taken to hold of its live holds."""
        book = self.books.get(node_id)
        return book.full - book.upper if book else 0

    def unreflected_now(self, node_id: str) -> int:
        """What the node's last sample cannot contain of its holds as they are now."""
        book = self.books.get(node_id)
        return book.now if book else 0

    def guessed_on(self, node_id: str) -> int:
        """Holds on the node whose expected length is a guess (`Hold.guessed`)."""
        book = self.books.get(node_id)
        return book.guessed if book else 0

    def prefill_backlog(self, node_id: str) -> int:
        """Prompt tokens sent to the node that have not produced a first token yet: what a
        newcomer's own prefill waits behind in the engine."""
        book = self.books.get(node_id)
        return book.prefill if book else 0

    def overlap(self, node_id: str, sample: NodeSample | None) -> float:
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
        book = self.books.get(node_id)
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

    # --- reflection ---------------------------------------------------------------------------

    def reflect(self, book: Book, sample: NodeSample) -> None:
        """Lower each live hold by what this sample already contains.

        For each live hold whose first token came at least `reflect_margin_s` before the
        sample: reflected = prompt + output known by then, never lowered, at most the full
        footprint less the overhead. Only the holds queued under an instant this cutoff has
        reached are recomputed; every other hold would come out unchanged.
        """
        if sample.kv_usage is None:
            return
        cutoff = sample.sampled_at - self.reflect_margin_s
        overhead = self.overhead
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

    def _reflect_hold(self, book: Book, hold: Hold, cutoff: float, overhead: int) -> None:
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
            self.schedule(hold)  # else settled: every instant is at or before the cutoff

    def schedule(self, hold: Hold, touched_at: float | None = None) -> None:
        """Queue `hold` under the next instant at which a sample could change its reflection.

        From its last recomputation's cutoff (`cut`) up to the next of its instants (first
        token and its count checkpoints) after `cut`, what a sample reflects
        of it is constant, so no sample before that instant needs to look at it; with no
        such instant it is settled. `touched_at` is the instant `first_token`/`grow` just
        wrote: if it is not after `cut` (a zero margin, a count taken at the cutoff's very
        time) the next sample looks. A fully reflected hold never changes again.
        """
        if hold.reflected >= hold.full - self.overhead:
            return
        first = hold.ticket.first_token_at
        if first is None:
            return  # nothing to reflect before a first token; first_token queues it
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
                return  # settled until grow changes it
        queued = hold.wake_at
        if queued is not None and queued <= wake:
            return  # already queued no later than needed; that look re-queues it
        hold.wake_at = wake
        book = self.books[hold.node_id]
        queue = book.wakeups
        fifo = queue.fifo
        if not fifo or fifo[-1][0] <= wake:
            fifo.append((wake, hold))
        else:
            heapq.heappush(queue.heap, (wake, next(self._wake_seq), hold))
        if len(fifo) + len(queue.heap) > 2 * len(book.holds) + 64:
            queue.compact()  # amortised O(1): at least half of it was dead
