"""The forecast: what each node will hold, and when room frees on it.

A node's *envelope* (`kvgate.core.plan.envelope`) is built here from three sources: this
replica's holds (`kvgate.core.plan.holds`), the other replicas' requests as of the last sync
(`PeerState`, `kvgate.core.replicas.peers`), and what was released since the node's last
sample (`NodeState.freed_unseen`: a load that ends now). Its base is `now`: the sample's
`used`, never less than what the holds take it to contain (`used`), plus what it cannot
contain yet; each hold runs
`R = E - output_so_far` more steps (`M - output_so_far` once it outlived `E`) holding
`P + output_so_far + ovh`. A newcomer fits when the envelope's peak with it stays under its
ceiling. Reserving `M` for a request's whole life leaves KV idle that nobody will use; the
envelope counts that room back as each request's end comes into view.

Each node's envelope is cached until its book (`Book.version`) or the peers change; a start
adds itself to the cached one (O(n), no re-sort) and a request that grows raises its base
(safe: see the envelope's docstring), so admission between two samples rarely rebuilds.

Time comes from the pace (`kvgate.core.plan.pace`): the *drain schedule* of a set of nodes
(when each running request ends and what it frees then) answers when `tokens` will have been
freed (`drain_time`: this replica's requests end at their likely lengths, a prediction of
when, not a plan); a newcomer's *start estimate* is the first end after which it fits
(`Envelope.start_step`) at the node's recent and fastest pace. The measured rate at which
tokens are freed (`freed`) answers when nothing runs to end. A prediction is `measured`
only when the pace of its nodes is and no request running there has a guessed length
(`Hold.guessed`; the other replicas' requests count as guessed while the caller's own model
is: they send the same traffic, and their views do not say).
"""

from __future__ import annotations

import bisect
import itertools

from kvgate.core.admission import StartEstimate
from kvgate.core.clock import Clock
from kvgate.core.nodes import NodeState
from kvgate.core.plan.envelope import Envelope
from kvgate.core.plan.holds import Book, Hold, Holds
from kvgate.core.plan.pace import Pace
from kvgate.core.rates import DecayingRate
from kvgate.core.replicas.peers import PeerState
from kvgate.core.settings import AdmissionSettings


class Forecast:
    """Each node's envelope, cached, and the predictions made from it."""

    def __init__(self, settings: AdmissionSettings, clock: Clock, holds: Holds, pace: Pace) -> None:
        self.settings = settings
        self.clock = clock
        self._holds = holds
        self._pace = pace
        self._overhead = settings.tuning.reservation_overhead_tokens
        # Other replicas' requests and claims (kvgate.core.replicas.peers), as of the last sync.
        self.peers = PeerState()
        self.peers_version = 0
        self.freed = DecayingRate(settings.tuning.release_rate_halflife_s)  # tokens freed / s
        self._envelopes: dict[str, tuple[tuple[int, int], Envelope]] = {}
        # Per pace (the likely, the fastest): the schedule, and the state it was made in.
        self._drain_cache: dict[bool, tuple[tuple[int, tuple[str, ...]], list[float], list[float]]]
        self._drain_cache = {}

    @property
    def pace(self) -> Pace:
        """Seconds per token of each node's streams (`kvgate.core.plan.pace`)."""
        return self._pace

    # --- keeping the cache true ---------------------------------------------------------------

    def opened(self, hold: Hold) -> None:
        """A request just started on its node (its hold is in the book already)."""
        node_id = hold.node_id
        book = self._holds.books[node_id]
        cached = self._envelopes.get(node_id)
        if cached is None:
            book.version += 1
            return
        version = (book.version, self.peers_version)
        book.version += 1
        if cached[0] == version:
            # Keep the cache: O(n) insert, no re-sort.
            cached[1].add(hold.prompt + self._overhead, hold.remaining())
            self._envelopes[node_id] = ((book.version, self.peers_version), cached[1])

    def progressed(self, hold: Hold, book: Book, output_tokens: int) -> None:
        """Keep the node's cached envelope safe as a request grows to `output_tokens`.

        An envelope of the same requests taken before they progressed, with its base raised
        by what they grew, counts every growth still to come from the older point and frees
        less at each end: it can only plan a higher peak, so it stays usable. Not so when a
        request passes its expected length: from then on it is planned to its cap, a longer
        future the cached envelope does not have, so it is rebuilt."""
        cached = self._envelopes.get(hold.node_id)
        if cached is None or cached[0] != (book.version, self.peers_version):
            return
        if hold.tok_cur < hold.expected <= output_tokens and hold.expected < hold.max_out:
            book.version += 1
        else:
            cached[1].base += output_tokens - hold.tok_cur

    def released(self, node_id: str) -> None:
        """A hold on the node was released (its book is gone if it was the last)."""
        book = self._holds.books.get(node_id)
        if book is None:
            self._envelopes.pop(node_id, None)  # a new book counts its versions anew
        else:
            book.version += 1

    def observed(self, node_id: str, book: Book | None) -> None:
        """The node has a new sample: its envelope's base is the sample's `used`."""
        self._envelopes.pop(node_id, None)
        if book is not None:
            book.version += 1

    def set_peers(self, state: PeerState) -> None:
        """The other replicas' state from the last sync: every envelope changes."""
        self.peers = state
        self.peers_version += 1

    def forget(self, node_id: str) -> None:
        self._envelopes.pop(node_id, None)

    # --- what a node holds --------------------------------------------------------------------

    def envelope(self, node: NodeState) -> Envelope:
        """The node's envelope (see the module docstring), cached until its book or the
        peers change."""
        node_id = node.node_id
        book = self._holds.books.get(node_id)
        key = (-1 if book is None else book.version, self.peers_version)
        cached = self._envelopes.get(node_id)
        if cached is not None and cached[0] == key and not node.freed_unseen:
            return cached[1]
        overhead = self._overhead
        loads: list[tuple[float, float]] = []
        base = self.used(node)
        if book is not None:
            loads = [(h.remaining(), h.prompt + h.tok_cur + overhead) for h in book.holds.values()]
            base += book.now
        peers = self.peers.nodes.get(node_id)
        if peers is not None:
            loads.extend(peers.loads)
            base += peers.unreflected
        if node.freed_unseen:
            loads.append((0, node.freed_unseen))  # released since the sample: ends now
        env = Envelope(base, loads)
        if not node.freed_unseen:
            self._envelopes[node_id] = (key, env)
        return env

    def own_envelope(self, node_id: str) -> Envelope:
        """This replica's requests alone, from zero (for its static share when isolated)."""
        book = self._holds.books.get(node_id)
        if book is None:
            return Envelope(0.0)
        overhead = self._overhead
        loads = [(h.remaining(), h.prompt + h.tok_cur + overhead) for h in book.holds.values()]
        return Envelope(sum(c for _, c in loads), loads)

    def used(self, node: NodeState) -> float:
        """What the node's last sample holds, never taken to be less than what the holds
        take it to contain: the live requests' reflected parts (this replica's and, as of
        the last sync, the others': `Holds.reflected_on`) and those of the requests
        released since the sample (`NodeState.freed_unseen`).

        The engine frees a request a little before the gateway reads its end, so a sample
        may or may not still hold a released request; and a sample rendered after the
        engine ended a request whose end has not been read yet lacks blocks its hold says
        the sample contains. The floor covers both: what was released leaves the plan once,
        as a load that ends now (`envelope`), never a second time at the end the plan
        expects.
        """
        claimed: float = self._holds.reflected_on(node.node_id) + node.freed_unseen
        peers = self.peers.nodes.get(node.node_id)
        if peers is not None:
            claimed += peers.reflected()
        return max(node.used, claimed)

    def peers_upper(self, node_id: str) -> float:
        """Other replicas' requests on the node if all grew to their end and none ended."""
        peers = self.peers.nodes.get(node_id)
        return 0.0 if peers is None else peers.upper

    def now_tokens(self, node: NodeState) -> float | None:
        """`now`: reported used tokens plus what the sample cannot contain yet."""
        if node.cap is None:
            return None
        return self.used(node) + self._holds.unreflected_now(node.node_id)

    def usage_now(self, node: NodeState) -> float | None:
        """What the node holds now as a fraction of its capacity (the panic gate's measure:
        `now` less what the sample most likely holds twice)."""
        capacity = node.capacity(self.settings)
        tokens = self.now_tokens(node)
        if capacity is None or tokens is None:
            return None
        return (tokens - self.unseen_overlap(node)) / capacity

    def unseen_overlap(self, node: NodeState) -> float:
        """Tokens the node's last sample most likely holds twice: this replica's requests'
        (`Holds.overlap`) and the other replicas' (as their views said at the last sync)."""
        peers = self.peers.nodes.get(node.node_id)
        own = self._holds.overlap(node.node_id, node.sample)
        if peers is None or not peers.unseen or node.sample is None:
            return own
        at = node.sample.sampled_at
        return own + sum(tokens for sent, tokens in peers.unseen if sent < at)

    # --- when ---------------------------------------------------------------------------------

    def time_left(self, hold: Hold, fastest: bool = False) -> float:
        """Seconds until the hold's request is expected to end; `fastest`: at its node's
        fastest pace (`Pace.fastest_step_s`)."""
        pace = self._pace.fastest_step_s if fastest else self._pace.step_s
        return hold.remaining() * pace(hold.node_id)

    def start_estimate(
        self, node: NodeState, final: float, limit: float, informed: bool = True
    ) -> StartEstimate | None:
        """When a newcomer that will hold at most `final` tokens could start on the node
        under `limit` tokens (what its last sample most likely holds twice does not count):
        None when it would not fit even once everything running has ended. `informed`: the
        newcomer's model's output lengths are learned (see the module docstring)."""
        limit += self.unseen_overlap(node)
        steps = self.envelope(node).start_step(final, limit)
        if steps is None:
            return None
        node_id = node.node_id
        pace = self._pace
        return StartEstimate(
            node_id,
            steps * pace.step_s(node_id),
            steps * pace.fastest_step_s(node_id),
            steps == 0 or self.measured(node_id, informed),
        )

    def measured(self, node_id: str, informed: bool = True) -> bool:
        """Do predictions on the node rest on measurements (see the module docstring)?"""
        if not self._pace.measured(node_id) or self._holds.guessed_on(node_id):
            return False
        return informed or node_id not in self.peers.nodes

    def drain_time(
        self, tokens: float, candidates: tuple[str, ...], generation: int, fastest: bool = False
    ) -> float | None:
        """When the candidates will have freed `tokens`: from the ends of what runs there
        (this replica's requests at their likely lengths, `Hold.likely_remaining`, each
        freeing the final footprint the plan holds for it; the others' as their views
        said), extrapolated past the last end at the average rate of those ends; else from
        the measured freeing rate. `generation` names the policy's state, for the cached
        schedule; `fastest`: at the nodes' fastest pace (`Pace.fastest_step_s`)."""
        if tokens <= 0:
            return 0.0
        times, freed = self._drain_schedule(candidates, generation, fastest)
        if times:
            i = bisect.bisect_left(freed, tokens)
            if i < len(times):
                return times[i]
            last = max(times[-1], 1e-3)
            return last + (tokens - freed[-1]) / (freed[-1] / last)
        rate = self.freed.value(self.clock.now())
        return tokens / rate if rate > 0 else None

    def _drain_schedule(
        self, candidates: tuple[str, ...], generation: int, fastest: bool
    ) -> tuple[list[float], list[float]]:
        """(end times, tokens freed by then) of the candidates' holds, this replica's and the
        others' (as of the last sync), cached until anything changes."""
        key = (generation, candidates)
        cached = self._drain_cache.get(fastest)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        books = self._holds.books
        current = self._holds.current
        ends: list[tuple[float, float]] = []
        for node_id in candidates:
            book = books.get(node_id)
            peers = self.peers.nodes.get(node_id)
            if not book and peers is None:
                continue
            pace = self._pace
            step = pace.fastest_step_s(node_id) if fastest else pace.step_s(node_id)
            for hold in book.holds.values() if book else ():
                ends.append((hold.likely_remaining() * step, current(hold) + hold.remaining()))
            for steps, held in () if peers is None else peers.loads:
                ends.append((steps * step, held + steps))  # other replicas' requests
        ends.sort()
        times = [at for at, _ in ends]
        freed = list(itertools.accumulate(amount for _, amount in ends))
        self._drain_cache[fastest] = (key, times, freed)
        return times, freed
