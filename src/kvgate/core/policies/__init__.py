"""Admission policies, selectable by `AdmissionSettings.policy`.

`build_policy(settings, clock)` is the one entry point; the flow controller
(`kvgate.core.flow`) is what the shell and the simulator hold, with the policy inside it.
`adaptive` is kvgate's; the others are baselines the benchmarks compare it with.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.core.clock import Clock
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.base import BasePolicy
from kvgate.core.policies.none import NonePolicy
from kvgate.core.policies.seed import SeedPolicy
from kvgate.core.policies.static import StaticConcurrencyPolicy, StaticQpsPolicy
from kvgate.core.settings import AdmissionSettings

PolicyFactory = Callable[..., BasePolicy]

_REGISTRY: dict[str, PolicyFactory] = {
    "none": NonePolicy,
    "static-qps": StaticQpsPolicy,
    "static-concurrency": StaticConcurrencyPolicy,
    "seed": SeedPolicy,
    "adaptive": AdaptivePolicy,
}


def build_policy(
    settings: AdmissionSettings,
    clock: Clock,
    *,
    rng_seed: int | None = None,
    lengths: OutputLengths | None = None,
) -> BasePolicy:
    """The policy named by `settings.policy` on `clock`, its randomness seeded by `rng_seed`
    (None: random)."""
    try:
        factory = _REGISTRY[settings.policy]
    except KeyError:
        raise ValueError(f"admission policy {settings.policy!r} is not available") from None
    return factory(settings, clock, rng_seed=rng_seed, lengths=lengths)


__all__ = [
    "AdaptivePolicy",
    "BasePolicy",
    "NonePolicy",
    "SeedPolicy",
    "StaticConcurrencyPolicy",
    "StaticQpsPolicy",
    "build_policy",
]
