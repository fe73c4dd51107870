"""Per-tenant in-flight accounting: how many KV tokens and requests each tenant holds now.

Pure, like the rest of the core: no I/O, no clock. A request takes a `Lease` before the
cluster admission runs and gives it back exactly once when it ends (a second `release` is
a no-op), so a tenant's usage can only return to zero, never drift: the failure mode of
gateways whose counters grow with every cancelled stream until the key is locked out.

Limits are upper bounds on what is *held*, not rates: a tenant at its limit is refused
(429) until one of its own requests ends, which its clients can see from the reason
`tenant_limit`. A request larger than the tenant's whole token limit is refused even when
the tenant is idle, since it could never fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Caps on what one tenant may hold at once; None means unlimited."""

    max_in_flight_tokens: int | None = None
    max_in_flight_requests: int | None = None


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


@dataclass
class TenantLedger:
    """The books of every tenant. `acquire` and `release` are O(1)."""

    limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    default_limits: TenantLimits = field(default_factory=TenantLimits)
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def limits_for(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, self.default_limits)

    def acquire(self, tenant: str, tokens: int) -> Lease | TenantRefusal:
        """Take `tokens` (and one request) from `tenant`'s budget, or say which limit blocks."""
        if tokens < 0:
            raise ValueError("a request cannot cost a negative number of tokens")
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage()
        limits = self.limits_for(tenant)
        refusal = _check(tenant, usage, limits, tokens)
        if refusal is not None:
            usage.refused_total += 1
            return refusal
        usage.tokens += tokens
        usage.requests += 1
        usage.admitted_total += 1
        return Lease(tenant=tenant, tokens=tokens)

    def release(self, lease: Lease) -> None:
        """Give the lease back; idempotent, so every exit path may call it."""
        if lease.released:
            return
        lease.released = True
        usage = self._usage[lease.tenant]
        usage.tokens -= lease.tokens
        usage.requests -= 1
        if usage.tokens < 0 or usage.requests < 0:  # impossible unless a lease was forged
            raise AssertionError(f"tenant {lease.tenant!r} released more than it held")

    def held(self, tenant: str) -> tuple[int, int]:
        """(tokens, requests) `tenant` holds now."""
        usage = self._usage.get(tenant)
        return (usage.tokens, usage.requests) if usage else (0, 0)

    @property
    def total_tokens(self) -> int:
        return sum(u.tokens for u in self._usage.values())

    @property
    def total_requests(self) -> int:
        return sum(u.requests for u in self._usage.values())

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
