"""Workloads whose prompts share prefixes, as token ids, for engines with prefix caching.

- `PrefixMix` (open loop, `prefix_mix`): each request is one of a few shared prefixes,
  drawn by weight, followed by a suffix of its own. With the weights equal it is RAG over a
  few documents (a document and a question), with `per_tenant` each prefix is one tenant's
  system prompt (the request names its tenant), with one heavy weight it is a hot prefix
  (`hot_prefix`: 80 % of the traffic on one prefix).
- `ChatSpec` (closed loop, `Chats`): multi-turn conversations. A turn's prompt is the
  history (the system prompt, every earlier message and answer) plus the new message; the
  next turn arrives a think time after the previous answer (`FollowUps`). An answer's ids
  are the engine's output ids (`kvgate.sim.model.prefix.output_ids`), so a next turn
  repeats exactly the tokens the engine cached. A turn that fails ends its conversation.
- `ideal_hit_rate`: the hit rate one cache of unbounded size would reach on a trace.

Token ids are drawn from a seeded generator (16-bit ids): the same seed, the same prompts.
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvgate.core.prefix.blocks import block_hashes
from kvgate.core.request import Priority
from kvgate.sim.model.prefix import output_ids
from kvgate.sim.workload import RequestSpec


def random_ids(rng: random.Random, count: int) -> tuple[int, ...]:
    """`count` token ids drawn from `rng`."""
    return tuple(array("H", rng.randbytes(2 * count)))


@dataclass(frozen=True, slots=True)
class PrefixMix:
    """Open-loop traffic on a few shared prefixes (see the module docstring)."""

    rate_rps: float = 10.0
    prefixes: int = 4
    prefix_tokens: int = 1000
    suffix_tokens: int = 100
    output_tokens: int = 150
    weights: tuple[float, ...] = ()  # per prefix; () = all equal
    per_tenant: bool = False  # prefix i is tenant "t{i}"'s system prompt
    ignore_eos: bool = True
    stream: bool = True
    priority: Priority = Priority.STANDARD


def hot_prefix(rate_rps: float, prefixes: int = 8, hot: float = 0.8, **kw: object) -> PrefixMix:
    """A mix with `hot` of the traffic on prefix 0 and the rest spread over the others."""
    rest = (1.0 - hot) / max(1, prefixes - 1)
    weights = (hot, *([rest] * (prefixes - 1)))
    return PrefixMix(rate_rps=rate_rps, prefixes=prefixes, weights=weights, **kw)  # type: ignore[arg-type]


def prefix_mix(spec: PrefixMix, duration_s: float, seed: int) -> Iterator[RequestSpec]:
    """Poisson arrivals in [0, duration_s) of `spec`'s requests, deterministic for a seed."""
    rng = random.Random(seed)
    shared = [random_ids(random.Random(seed * 7919 + i), spec.prefix_tokens)
              for i in range(spec.prefixes)]  # fmt: skip
    weights = spec.weights or (1.0,) * spec.prefixes
    cum = list(itertools.accumulate(weights))
    t, index = 0.0, 0
    while True:
        t += rng.expovariate(spec.rate_rps)
        if t >= duration_s:
            return
        k = min(spec.prefixes - 1, _bisect(cum, rng.random() * cum[-1]))
        ids = shared[k] + random_ids(rng, spec.suffix_tokens)
        yield RequestSpec(
            index, t, len(ids), spec.output_tokens, spec.ignore_eos, spec.priority, spec.stream,
            id=f"p{k}-{index}", kind=f"prefix-{k}", tenant=f"t{k}" if spec.per_tenant else "",
            prompt_ids=ids,
        )  # fmt: skip
        index += 1


def _bisect(cum: list[float], x: float) -> int:
    for i, c in enumerate(cum):
        if x < c:
            return i
    return len(cum) - 1


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """Multi-turn conversations: `conversations` of `turns` turns each, starting uniformly
    over `start_window_s`; each turn adds `user_tokens` and asks for `output_tokens`
    (ignoring EOS), the next one `think_s` (exponential mean) after the answer. With
    `tenants` > 1 each tenant has its own system prompt."""

    conversations: int = 200
    turns: int = 5
    system_tokens: int = 1000
    user_tokens: int = 200
    output_tokens: int = 300
    think_s: float = 1.0
    start_window_s: float = 10.0
    tenants: int = 1
    stream: bool = True
    priority: Priority = Priority.STANDARD


class Chats:
    """The conversations of a `ChatSpec`: their first turns, then each next turn as the
    answers come (`FollowUps`). `issued` keeps every request handed out, by id."""

    def __init__(self, spec: ChatSpec, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.issued: dict[str, RequestSpec] = {}
        self._system = [random_ids(random.Random(seed * 31 + t), spec.system_tokens)
                        for t in range(max(1, spec.tenants))]  # fmt: skip

    def first_turns(self) -> list[RequestSpec]:
        spec = self.spec
        rng = random.Random(self.seed)
        starts = sorted((rng.uniform(0.0, spec.start_window_s), c)
                        for c in range(spec.conversations))  # fmt: skip
        out = []
        for start, conv in starts:
            tenant = conv % len(self._system)
            ids = self._system[tenant] + self._message(conv, 0)
            out.append(self._request(conv, 0, start, ids))
        return out

    def next_turn(
        self, done: RequestSpec, ended_at: float, output_tokens: int
    ) -> RequestSpec | None:
        conv, turn = _parse(done.id)
        if turn + 1 >= self.spec.turns or done.prompt_ids is None:
            return None
        history = done.prompt_ids + output_ids(output_tokens) + self._message(conv, turn + 1)
        think = random.Random(self._key(conv, turn + 1) + 1).expovariate(1.0 / self.spec.think_s)
        return self._request(conv, turn + 1, ended_at + think, history)

    def _message(self, conv: int, turn: int) -> tuple[int, ...]:
        return random_ids(random.Random(self._key(conv, turn)), self.spec.user_tokens)

    def _key(self, conv: int, turn: int) -> int:
        return (self.seed * 1_000_003 + conv) * 1009 + turn * 2

    def _request(self, conv: int, turn: int, at: float, ids: tuple[int, ...]) -> RequestSpec:
        spec = self.spec
        request = RequestSpec(
            conv * spec.turns + turn, at, len(ids), spec.output_tokens, True, spec.priority,
            spec.stream, id=f"c{conv}-t{turn}", kind=f"turn-{turn}",
            tenant=f"t{conv % len(self._system)}" if spec.tenants > 1 else "", prompt_ids=ids,
        )  # fmt: skip
        self.issued[request.id] = request
        return request


def _parse(request_id: str) -> tuple[int, int]:
    conv, turn = request_id[1:].split("-t")
    return int(conv), int(turn)


def ideal_hit_rate(
    trace: Iterable[tuple[tuple[int, ...], int]], block_size: int
) -> tuple[int, int]:
    """(queries, hits) in tokens of one cache of unbounded size that every request of
    `trace` reaches, taken in order: each a prompt's ids and the output tokens it
    produced. Counted as an engine counts (full blocks, the last prompt token always
    computed); a request's prompt and output blocks are cached for the ones after it."""
    seen: set[int] = set()
    queries = hits = 0
    for ids, produced in trace:
        hashes = block_hashes(ids + output_ids(max(0, produced - 1)), block_size)
        limit = (len(ids) - 1) // block_size
        hit = 0
        for h in hashes[:limit]:
            if h not in seen:
                break
            hit += 1
        queries += len(ids)
        hits += hit * block_size
        seen.update(hashes)
    return queries, hits
