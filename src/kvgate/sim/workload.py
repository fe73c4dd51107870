"""Request streams for the virtual-time simulator: Poisson arrivals, lognormal lengths.

A `WorkloadSpec` says how fast requests come (one rate, or phases of rates, to model a
surge) and what they look like (prompt and `max_tokens` lengths, how many ignore EOS,
the priority mix, how many stream). `generate` turns it into a deterministic, lazily
produced sequence of `RequestSpec` for a seed. `estimate_capacity_rps` gives a rough
sustainable rate for a cluster, so that "3x overload" means something concrete.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvgate.core.request import Priority
from kvgate.sim.model.engine import EngineConfig


@dataclass(frozen=True, slots=True)
class Phase:
    duration_s: float
    rate_rps: float


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of the traffic. Lengths are lognormal with the given mean and sigma (of log)."""

    rate_rps: float = 10.0
    phases: tuple[Phase, ...] = ()
    prompt_mean: float = 1000.0
    prompt_sigma: float = 0.8
    max_tokens_mean: float = 400.0
    max_tokens_sigma: float = 0.5
    ignore_eos_fraction: float = 0.0
    priority_weights: tuple[float, float, float] = (0.1, 0.7, 0.2)  # critical/std/sheddable
    stream_fraction: float = 1.0

    def rate_at(self, t: float) -> float:
        """The arrival rate at time t (phases repeat from the start when they run out)."""
        if not self.phases:
            return self.rate_rps
        total = sum(p.duration_s for p in self.phases)
        t = t % total if total > 0 else 0.0
        for phase in self.phases:
            if t < phase.duration_s:
                return phase.rate_rps
            t -= phase.duration_s
        return self.phases[-1].rate_rps


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    arrival: float
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    priority: Priority
    stream: bool
    id: str = ""  # the caller's name for it ("" = "r{index}")
    kind: str = ""  # the caller's class of request (the benchmark's "chat" / "long")
    tenant: str = ""  # who sent it (fairness, tenant limits)
    # The prompt's token ids (`prompt_tokens` of them): what lets a prefix-caching engine
    # share its blocks (`kvgate.sim.prefix_workloads`); None shares nothing.
    prompt_ids: tuple[int, ...] | None = None


class FollowUps(Protocol):
    """Requests that depend on earlier answers (a conversation's next turn)."""

    def next_turn(
        self, done: RequestSpec, ended_at: float, output_tokens: int
    ) -> RequestSpec | None:
        """The request that follows `done`, answered at `ended_at` with `output_tokens`
        tokens (None: nothing follows); it arrives at or after `ended_at`."""


def _lognormal_mu(mean: float, sigma: float) -> float:
    """The mu of a lognormal whose *mean* (not median) is `mean`."""
    return math.log(mean) - sigma * sigma / 2.0


def generate(
    spec: WorkloadSpec, duration_s: float, seed: int, max_model_len: int
) -> Iterator[RequestSpec]:
    """Requests arriving in [0, duration_s), in arrival order, deterministic for a seed.

    Lengths are clipped so that prompt + max_tokens fits the model (as a client that reads
    the model's limit would do); rate changes between phases are handled by thinning.
    Written for speed: the virtual-time mode draws millions of these.
    """
    rng = random.Random(seed)
    peak = max([spec.rate_rps, *(p.rate_rps for p in spec.phases)])
    if peak <= 0:
        return
    priorities = (Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE)
    total_weight = sum(spec.priority_weights)
    cum = list(itertools.accumulate(w / total_weight for w in spec.priority_weights))
    out_mu = _lognormal_mu(spec.max_tokens_mean, spec.max_tokens_sigma)
    in_mu = _lognormal_mu(spec.prompt_mean, spec.prompt_sigma)
    out_sigma, in_sigma = spec.max_tokens_sigma, spec.prompt_sigma
    out_cap = max_model_len // 2
    expovariate, gauss, uniform, exp = rng.expovariate, rng.gauss, rng.random, math.exp
    phased = bool(spec.phases)
    t, index = 0.0, 0
    while True:
        t += expovariate(peak)
        if t >= duration_s:
            return
        if phased and uniform() * peak > spec.rate_at(t):
            continue
        max_tokens = max(1, min(int(exp(gauss(out_mu, out_sigma))), out_cap))
        prompt = max(1, min(int(exp(gauss(in_mu, in_sigma))), max_model_len - max_tokens - 1))
        yield RequestSpec(
            index,
            t,
            prompt,
            max_tokens,
            uniform() < spec.ignore_eos_fraction,
            priorities[min(2, bisect.bisect(cum, uniform()))],
            uniform() < spec.stream_fraction,
        )
        index += 1


def estimate_capacity_rps(config: EngineConfig, spec: WorkloadSpec, nodes: int = 1) -> float:
    """A rough sustainable request rate for `nodes` engines of `config` under `spec`.

    Concurrency is what fits in ~90 % of the KV cache at the average footprint (prompt
    plus half the output) capped by `max_num_seqs`; a step of that batch takes the
    roofline time; prefill time is charged per request. Good to a factor ~1.3, which is
    all "3x overload" needs.
    """
    rng = random.Random(12345)
    steady = dataclasses.replace(spec, rate_rps=1.0, phases=())
    samples = generate(steady, 1e9, 7, config.max_model_len)
    prompts, outputs = [], []
    for _, req in zip(range(4000), samples, strict=False):
        prompts.append(req.prompt_tokens)
        if req.ignore_eos:
            outputs.append(req.max_tokens)
        else:
            eos = 1 + int(math.log(1.0 - rng.random()) / math.log1p(-1 / config.eos_mean_tokens))
            outputs.append(min(req.max_tokens, eos))
    p = sum(prompts) / len(prompts)
    o = sum(outputs) / len(outputs)
    footprint = p + o / 2.0
    batch = min(config.max_num_seqs, 0.9 * config.usable_blocks * config.block_size / footprint)
    lat = config.latency
    step = lat.fixed_s + lat.per_seq_s * batch + lat.per_context_token_s * batch * footprint
    decode_rps = batch / step / o  # requests per second if decoding were all
    per_request_prefill = p * lat.per_prefill_token_s
    rate = decode_rps / (1.0 + decode_rps * per_request_prefill)
    return rate * nodes
