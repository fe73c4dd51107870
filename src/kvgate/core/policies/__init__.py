"""Placement policies: `adaptive` is kvgate's, and the only one production builds.

`build_policy(settings, clock)` is what the gateway calls; the flow controller
(`kvgate.core.flow`) holds the policy and speaks to it through
`kvgate.core.admission.AdmissionPolicy`. `base` is what every policy shares (a composition
of the per-node plan, `kvgate.core.plan`, and the replica claims, `kvgate.core.replicas`);
`adaptive` decides with it. The baselines the benchmarks compare kvgate with live in
`baselines`, with a registry of their own that only the simulator, the benchmarks and the
tests use.
"""

from __future__ import annotations

from kvgate.core.admission import AdmissionPolicy
from kvgate.core.clock import Clock
from kvgate.core.plan.lengths import OutputLengths
from kvgate.core.policies.adaptive import AdaptivePolicy
from kvgate.core.policies.base import BasePolicy
from kvgate.core.settings import AdmissionSettings


def build_policy(
    settings: AdmissionSettings,
    clock: Clock,
    *,
    rng_seed: int | None = None,
    lengths: OutputLengths | None = None,
) -> AdmissionPolicy:
    """kvgate's placement (`AdaptivePolicy`) on `clock`, its randomness seeded by
    `rng_seed` (None: random)."""
    return AdaptivePolicy(settings, clock, rng_seed=rng_seed, lengths=lengths)


__all__ = ["AdaptivePolicy", "BasePolicy", "build_policy"]
