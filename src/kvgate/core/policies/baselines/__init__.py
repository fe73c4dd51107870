"""The baselines the benchmarks compare kvgate with, and the registry that builds them.

None of them protects anything; production never builds one (`kvgate.core.policies
.build_policy` builds `adaptive` only, and no setting selects another). The simulator
(`kvgate.sim`), the benchmark (`kvgate bench`, and its gateway for live runs,
`kvgate.bench.serve`), the scripts under `benchmarks/` and the tests build them here, by
name, next to `adaptive`:

- `none` (`none.py`): admit everything, route to the least loaded node (fewest requests in
  flight): the "least-loaded" load balancer;
- `round-robin` (`round_robin.py`): admit everything, each request to the next node in turn;
- `static-qps`, `static-concurrency` (`static.py`): a conventional gateway's fixed quota,
  a token bucket or a cap on requests in flight (`BaselineOptions`);
- `seed` (`seed.py`): a port of the original sketch's behaviour, flaws included;
- `headroom-only`, `prefix-aware`: `adaptive` with one routing or the other
  (`kvgate.core.policies.routing`; `prefix-aware` is `adaptive`'s own), to compare them on
  the same admission;
- `adaptive-fixed`: kvgate's own policy with its planned peak held under the fixed
  watermarks, never above the cache (`AdaptivePolicy(overbook=False)`): the ceiling before
  it was measured (`kvgate.core.plan.ceiling`).
"""

from __future__ import annotations

from typing import Literal, get_args

from kvgate.core.admission import AdmissionPolicy
from kvgate.core.clock import Clock
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.baselines.none import NonePolicy
from kvgate.core.policies.baselines.round_robin import RoundRobinPolicy
from kvgate.core.policies.baselines.seed import SeedPolicy
from kvgate.core.policies.baselines.static import (
    BaselineOptions,
    StaticConcurrencyPolicy,
    StaticQpsPolicy,
)
from kvgate.core.settings import AdmissionSettings

PolicyName = Literal[
    "adaptive",
    "none",
    "round-robin",
    "static-qps",
    "static-concurrency",
    "seed",
    "headroom-only",
    "prefix-aware",
    "adaptive-fixed",
]
#: Every policy a benchmark may name: kvgate's first, then the baselines.
POLICY_NAMES: tuple[PolicyName, ...] = get_args(PolicyName)


def policy_name(name: str) -> PolicyName:
    """`name` as a `PolicyName`; ValueError when no policy is called that."""
    for known in POLICY_NAMES:
        if known == name:
            return known
    raise ValueError(_unknown(name))


def build_named(
    name: PolicyName,
    settings: AdmissionSettings,
    clock: Clock,
    *,
    rng_seed: int | None = None,
    lengths: OutputLengths | None = None,
    options: BaselineOptions | None = None,
) -> AdmissionPolicy:
    """The policy called `name` (one of `POLICY_NAMES`) on `clock`; ValueError for another."""
    quota = options if options is not None else BaselineOptions()
    if name == "adaptive":
        return AdaptivePolicy(settings, clock, rng_seed=rng_seed, lengths=lengths)
    if name == "none":
        return NonePolicy(settings, clock, rng_seed=rng_seed, lengths=lengths)
    if name == "round-robin":
        return RoundRobinPolicy(settings, clock, rng_seed=rng_seed, lengths=lengths)
    if name == "static-qps":
        return StaticQpsPolicy(settings, clock, quota, rng_seed=rng_seed, lengths=lengths)
    if name == "static-concurrency":
        return StaticConcurrencyPolicy(settings, clock, quota, rng_seed=rng_seed, lengths=lengths)
    if name == "seed":
        return SeedPolicy(settings, clock, rng_seed=rng_seed, lengths=lengths)
    if name == "headroom-only":
        return AdaptivePolicy(
            settings, clock, rng_seed=rng_seed, lengths=lengths, routing="headroom"
        )
    if name == "prefix-aware":
        return AdaptivePolicy(settings, clock, rng_seed=rng_seed, lengths=lengths, routing="prefix")
    if name == "adaptive-fixed":
        return AdaptivePolicy(settings, clock, rng_seed=rng_seed, lengths=lengths, overbook=False)
    raise ValueError(_unknown(name))


def _unknown(name: str) -> str:
    return f"no policy is called {name!r}; choose from {', '.join(POLICY_NAMES)}"


__all__ = [
    "POLICY_NAMES",
    "BaselineOptions",
    "NonePolicy",
    "PolicyName",
    "RoundRobinPolicy",
    "SeedPolicy",
    "StaticConcurrencyPolicy",
    "StaticQpsPolicy",
    "build_named",
    "policy_name",
]
