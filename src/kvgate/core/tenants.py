"""Per-tenant in-flight accounting: how many KV tokens and requests each tenant holds now.

Pure, like the rest of the core: no I/O, no clock. A request takes a `Lease` before the
cluster admission runs and gives it back exactly once when it ends (a second `release` is
a no-op), so a tenant's usage can only return to zero, never drift: the failure mode of
gateways whose counters grow with every cancelled stream until the key is locked out.

Limits are upper bounds on what is *held*, not rates. The flow controller
(`kvgate.core.flow`) checks them when it is about to start a request: a tenant at its limit
has its requests wait until one of its own ends, and a request larger than the tenant's
whole token limit is refused at once, since it could never start. How soon a tenant frees
room (for its Retry-After) is measured per tenant from its own releases.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.core.rates import DecayingRate
from kvgate.core.request import DEFAULT_TENANT

# Half-life of a tenant's measured rate of freeing tokens.
RELEASE_HALFLIFE_S = 5.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Caps on what one tenant may hold at once; None means unlimited."""

    max_in_flight_tokens: int | None = None
    max_in_flight_requests: int | None = None


_UNLIMITED = TenantLimits()


@dataclass(slots=True, eq=False)
class Lease:
    """One request's hold on its tenant's budget. Identity makes two leases distinct."""

    tenant: str
    tokens: int
    released: bool = False


@dataclass(frozen=True, slots=True)
class TenantRefusal:
    """Why a lease was refused: the limit that would be exceeded."""

    tenant: str
    limit: str  # "tokens" or "requests"
    held: int
    requested: int
    maximum: int

    @property
    def message(self) -> str:
        unit = "KV tokens" if self.limit == "tokens" else "requests"
        return (
            f"Tenant `{self.tenant}` holds {self.held} of its {self.maximum} in-flight {unit}; "
            f"this request needs {self.requested}."
        )


@dataclass(slots=True)
class _Usage:
    tokens: int = 0
    requests: int = 0
    admitted_total: int = 0
    refused_total: int = 0
    freed: DecayingRate = field(default_factory=lambda: DecayingRate(RELEASE_HALFLIFE_S))


@dataclass
class TenantLedger:
    """The books of every tenant. `acquire` and `release` are O(1)."""

    limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    _usage: dict[str, _Usage] = field(default_factory=dict)
    # Other replicas' usage per tenant (tokens, requests), and the number of replicas whose
    # limits must be split statically when their usage cannot be seen (kvgate.core.replicas.peers).
    peers: dict[str, tuple[int, int]] = field(default_factory=dict)
    split: int = 1
    # With other replicas: what this replica may still add per tenant [tokens, requests]
    # until the next sync (a tenant not listed: nothing), so that replicas never both take
    # a tenant's last room; and what is left of its published claims. None: no replicas.
    allowance: dict[str, list[float]] | None = None
    _claims: dict[str, list[float]] = field(default_factory=dict)

    def limits_for(self, tenant: str) -> TenantLimits:
        """The tenant's limits as this replica must apply them (its part when isolated).
        Requests without a tenant (a gateway without API keys) have none: limits are the
        operator's per-tenant caps, not a cap on the whole gateway."""
        if tenant == DEFAULT_TENANT:
            return _UNLIMITED
        limits = self.limits.get(tenant, self.default_limits)
        if self.split <= 1:
            return limits
        tokens, requests = limits.max_in_flight_tokens, limits.max_in_flight_requests
        return TenantLimits(
            None if tokens is None else tokens // self.split,
            None if requests is None else max(1, requests // self.split),
        )

    def _held(self, tenant: str, usage: _Usage | None) -> _Usage:
        """Usage counted against the limits: this replica's and the other replicas'."""
        tokens, requests = self.peers.get(tenant, (0, 0))
        if usage is None:
            return _Usage(tokens=tokens, requests=requests)
        if not tokens and not requests:
            return usage
        return _Usage(tokens=usage.tokens + tokens, requests=usage.requests + requests)

    def local_usage(self) -> dict[str, tuple[int, int]]:
        """(tokens, requests) per tenant held through this replica."""
        return {t: (u.tokens, u.requests) for t, u in self._usage.items() if u.requests}

    def check(self, tenant: str, tokens: int) -> TenantRefusal | None:
        """Which limit would block taking `tokens` now (None: it may start)."""
        usage = self._held(tenant, self._usage.get(tenant))
        limits = self.limits_for(tenant)
        refusal = _check(tenant, usage, limits, tokens)
        if refusal is None and self.allowance is not None:
            refusal = self._beyond_allowance(tenant, usage, limits, tokens)
        return refusal

    def remaining(self, tenant: str) -> tuple[float | None, float | None]:
        """(tokens, requests) the tenant's limits leave across replicas (None: no limit)."""
        usage = self._held(tenant, self._usage.get(tenant))
        limits = self.limits_for(tenant)
        tokens = limits.max_in_flight_tokens
        requests = limits.max_in_flight_requests
        return (
            None if tokens is None else max(0, tokens - usage.tokens),
            None if requests is None else max(0, requests - usage.requests),
        )

    def claim(
        self, tenants: list[str], part: Callable[[str, float | None, bool], float]
    ) -> dict[str, list[float]]:
        """This replica's claims on what each limited tenant's limits leave, to publish
        now: `part(tenant, left, whole)` of the tokens and of the requests (`whole`). What
        it may add can only shrink to the claim, since the others plan around it from now."""
        claims: dict[str, list[float]] = {}
        for tenant in tenants:
            left_tokens, left_requests = self.remaining(tenant)
            claims[tenant] = [part(tenant, left_tokens, False), part(tenant, left_requests, True)]
            if self.allowance is not None and tenant in self.allowance:
                mine = self.allowance[tenant]
                self.allowance[tenant] = [
                    min(a, c) for a, c in zip(mine, claims[tenant], strict=True)
                ]
        self._claims = claims
        return claims

    def is_limited(self, tenant: str) -> bool:
        limits = self.limits_for(tenant)
        return limits.max_in_flight_tokens is not None or limits.max_in_flight_requests is not None

    def set_peer_claims(self, claimed: Mapping[str, tuple[float, float]] | None) -> None:
        """A sync that published this replica's last `claim()`: until the next one it may add
        what is left of its claim and only what the others' claims leave (None: alone)."""
        if claimed is None:
            self.allowance, self._claims = None, {}
            return
        allowance: dict[str, list[float]] = {}
        for tenant, mine in self._claims.items():
            left = self.remaining(tenant)
            theirs = claimed.get(tenant, (0.0, 0.0))
            allowance[tenant] = [
                c if room is None else max(0.0, min(c, room - other))
                for c, room, other in zip(mine, left, theirs, strict=True)
            ]
        self.allowance = allowance

    def _beyond_allowance(
        self, tenant: str, usage: _Usage, limits: TenantLimits, tokens: int
    ) -> TenantRefusal | None:
        assert self.allowance is not None
        allowed = self.allowance.get(tenant, (0.0, 0.0))
        cap = limits.max_in_flight_requests
        if cap is not None and 1 > allowed[1] + 1e-9:
            return TenantRefusal(tenant, "requests", usage.requests, 1, cap)
        cap = limits.max_in_flight_tokens
        if cap is not None and tokens > allowed[0] + 1e-9:
            return TenantRefusal(tenant, "tokens", usage.tokens, tokens, cap)
        return None

    def never_fits(self, tenant: str, tokens: int) -> TenantRefusal | None:
        """The limit a request of `tokens` exceeds even with the tenant idle, if any."""
        return _check(tenant, _Usage(), self.limits_for(tenant), tokens)

    def acquire(self, tenant: str, tokens: int) -> Lease | TenantRefusal:
        """Take `tokens` (and one request) from `tenant`'s budget, or say which limit blocks."""
        if tokens < 0:
            raise ValueError("a request cannot cost a negative number of tokens")
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        refusal = self.check(tenant, tokens)
        if refusal is not None:
            return refusal
        if self.allowance is not None:
            for book in (self.allowance, self._claims):
                if tenant in book:
                    book[tenant][0] -= tokens
                    book[tenant][1] -= 1
        usage.tokens += tokens
        usage.requests += 1
        usage.admitted_total += 1
        return Lease(tenant=tenant, tokens=tokens)

    def refused(self, tenant: str) -> None:
        """Count a request of `tenant` refused because of its limits."""
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        usage.refused_total += 1

    def release(self, lease: Lease, now: float = 0.0) -> None:
        """Give the lease back; idempotent, so every exit path may call it."""
        if lease.released:
            return
        lease.released = True
        usage = self._usage[lease.tenant]
        usage.tokens -= lease.tokens
        usage.requests -= 1
        usage.freed.add(now, lease.tokens)
        if usage.tokens < 0 or usage.requests < 0:  # impossible unless a lease was forged
            raise AssertionError(f"tenant {lease.tenant!r} released more than it held")

    def wait_estimate(self, tenant: str, tokens: int, now: float) -> float | None:
        """Seconds until `tenant` has room for `tokens`, at the rate it has been freeing
        tokens recently (None: it has freed nothing lately)."""
        usage = self._usage.get(tenant)
        refusal = self.check(tenant, tokens)
        if usage is None or refusal is None:
            return 0.0
        rate = usage.freed.value(now)
        if rate <= 0:
            return None
        if refusal.limit == "requests":
            per_request = usage.tokens / max(1, usage.requests)
            return per_request / rate
        return max(0.0, refusal.held + tokens - refusal.maximum) / rate

    def held(self, tenant: str) -> tuple[int, int]:
        """(tokens, requests) `tenant` holds now."""
        usage = self._usage.get(tenant)
        return (usage.tokens, usage.requests) if usage else (0, 0)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able usage per tenant, for `/admin/state` and `/metrics`."""
        out: dict[str, Any] = {}
        for tenant, usage in sorted(self._usage.items()):
            limits = self.limits_for(tenant)
            out[tenant] = {
                "in_flight_tokens": usage.tokens,
                "in_flight_requests": usage.requests,
                "max_in_flight_tokens": limits.max_in_flight_tokens,
                "max_in_flight_requests": limits.max_in_flight_requests,
                "admitted_total": usage.admitted_total,
                "refused_total": usage.refused_total,
            }
        return out


def _check(tenant: str, usage: _Usage, limits: TenantLimits, tokens: int) -> TenantRefusal | None:
    cap = limits.max_in_flight_requests
    if cap is not None and usage.requests + 1 > cap:
        return TenantRefusal(tenant, "requests", usage.requests, 1, cap)
    cap = limits.max_in_flight_tokens
    if cap is not None and usage.tokens + tokens > cap:
        return TenantRefusal(tenant, "tokens", usage.tokens, tokens, cap)
    return None
