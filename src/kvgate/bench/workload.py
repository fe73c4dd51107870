"""The overload scenario, as a seeded list of arrivals.

Traffic is a steady Poisson stream of short chat turns and long "summarize this document"
requests (prompt 25-50% of one node's KV cache), plus periodic bursts of long requests.
Everything scales with one number, `load`: 1.0 is the cluster's measured sustainable
capacity (see `kvgate.bench.suite`), so 3.0 offers three times what the cluster can serve.
Arrivals are drawn from the seed alone, never from a policy's behaviour, so every policy
faces exactly the same users. How the users' clients behave is `kvgate.sim.runs.ClientModel`,
the same in virtual and live runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    """The mix at 1x load, relative to one node (so it scales with the cluster).

    `chat_rate` and `long_rate` are Poisson arrivals per second per node; every
    `burst_every_s` seconds `burst_per_node * nodes` long requests arrive at once.
    """

    kv_capacity_tokens: int
    chat_rate: float
    long_rate: float
    burst_every_s: float
    burst_per_node: float
    chat_prompt: tuple[int, int] = (30, 70)
    chat_output: tuple[int, int] = (50, 200)
    long_prompt_frac: tuple[float, float] = (0.25, 0.50)
    long_output: tuple[int, int] = (200, 400)
    first_burst_s: float = 20.0

    def scaled(self, factor: float) -> Shape:
        """The same mix with all arrival rates and burst sizes multiplied by `factor`."""
        return replace(
            self,
            chat_rate=self.chat_rate * factor,
            long_rate=self.long_rate * factor,
            burst_per_node=self.burst_per_node * factor,
        )


@dataclass(frozen=True, slots=True)
class Arrival:
    """One user request as offered: when, what kind, how big."""

    id: str
    t: float
    kind: str  # "chat" or "long"
    prompt_tokens: int
    max_tokens: int
    burst: bool = False


def burst_times(shape: Shape, duration_s: float) -> list[float]:
    """When the bursts start (none if `burst_every_s` <= 0)."""
    if shape.burst_every_s <= 0 or shape.burst_per_node <= 0:
        return []
    return [float(t) for t in np.arange(shape.first_burst_s, duration_s, shape.burst_every_s)]


def generate(shape: Shape, nodes: int, duration_s: float, load: float, seed: int) -> list[Arrival]:
    """All arrivals of a run, sorted by time: Poisson chat + Poisson long + long bursts."""
    s = shape.scaled(load)
    rng = np.random.default_rng([seed, 6])
    out: list[Arrival] = []
    out += _poisson(rng, "chat", s.chat_rate * nodes, duration_s, s)
    out += _poisson(rng, "long", s.long_rate * nodes, duration_s, s)
    size = round(s.burst_per_node * nodes)
    for k, start in enumerate(burst_times(s, duration_s)):
        # A burst lands within 200 ms: inside one or a few scrape periods.
        offsets = np.sort(rng.uniform(0.0, 0.2, size))
        for j, off in enumerate(offsets):
            p, m = _long_size(rng, s)
            out.append(Arrival(f"b{k}-{j}", start + float(off), "long", p, m, burst=True))
    out.sort(key=lambda a: a.t)
    return out


def _poisson(
    rng: np.random.Generator, kind: str, rate: float, duration_s: float, s: Shape
) -> list[Arrival]:
    if rate <= 0:
        return []
    n = int(rng.poisson(rate * duration_s))
    times = np.sort(rng.uniform(0.0, duration_s, n))
    out = []
    for i, t in enumerate(times):
        if kind == "chat":
            p = int(rng.integers(s.chat_prompt[0], s.chat_prompt[1] + 1))
            m = int(rng.integers(s.chat_output[0], s.chat_output[1] + 1))
        else:
            p, m = _long_size(rng, s)
        out.append(Arrival(f"{kind[0]}{i}", float(t), kind, p, m))
    return out


def _long_size(rng: np.random.Generator, s: Shape) -> tuple[int, int]:
    lo, hi = s.long_prompt_frac
    prompt = int(s.kv_capacity_tokens * rng.uniform(lo, hi))
    return prompt, int(rng.integers(s.long_output[0], s.long_output[1] + 1))


def offered_tokens_per_s(shape: Shape, nodes: int, load: float) -> float:
    """Mean output tokens per second the users ask for at `load` (bursts averaged in)."""
    s = shape.scaled(load)
    chat = s.chat_rate * nodes * sum(s.chat_output) / 2
    long_rate = s.long_rate * nodes
    if s.burst_every_s > 0:
        long_rate += s.burst_per_node * nodes / s.burst_every_s
    return chat + long_rate * sum(s.long_output) / 2
