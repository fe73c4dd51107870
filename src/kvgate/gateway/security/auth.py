"""Client authentication and tenant limits: kvgate's front door.

`FrontDoor` runs before routing, only when keys are configured (without keys it is not on
the request path at all):

- `/v1/...` needs a client key (`Authorization: Bearer <key>`, as the OpenAI SDKs send it,
  or `x-api-key`). The key names a tenant and a priority range: a request without
  `X-Kvgate-Priority` gets the key's default, one asking for more than the key allows is
  lowered to the key's maximum (never refused: clients that always ask for `critical` keep
  working, they just are not believed). The client's key is removed from the headers, so
  it never reaches an engine; engines get their own `backends[].api_key`, if any.
- `/admin/...` and `/dashboard...` need no client key: they are the admin check's
  (`kvgate.gateway.security.admin`, the same rule with or without keys).
- `/healthz`, `/readyz` and `/metrics` stay open, for probes and Prometheus.

Keys are never compared as plain text: the presented key is hashed (SHA-256), its digest
looked up among the configured digests and confirmed with `hmac.compare_digest`, so the
timing tells an attacker nothing about how close a guess was (see `KeyRing`). Digests,
not keys, are kept in memory, and nothing here logs a key.

The front door leaves the key's tenant in the ASGI scope (`TENANT_SCOPE_KEY`); the relay
puts it on the request's `AdmissionRequest`, and the core's flow controller enforces the
tenant's limits and budgets next to its fairness (`kvgate.core.flow`, `kvgate.core.tenants`,
`kvgate.core.budgets`). This module owns the `TenantLedger` and the `Budgets` they live in,
so a reload can change them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.core.budgets import BudgetLimits, Budgets
from kvgate.core.request import Priority
from kvgate.core.tenants import TenantLedger, TenantLimits
from kvgate.gateway.http.asgi import TENANT_SCOPE_KEY, ASGIApp, Receive, Scope, Send
from kvgate.gateway.http.errors import GatewayError, send_error
from kvgate.gateway.security.admin import AdminGuard, is_admin_path
from kvgate.gateway.security.settings import AuthSettings, TenantSettings

log = logging.getLogger(__name__)


_CLIENT_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
_PRIORITY_HEADER = b"x-kvgate-priority"
_OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """What a valid key grants. Holds the key's digest, never the key."""

    digest: bytes
    tenant: str
    default_priority: Priority
    max_priority: Priority

    def effective_priority(self, asked: Priority | None) -> Priority:
        """The key's default when nothing is asked; never above the key's maximum."""
        wanted = self.default_priority if asked is None else asked
        return Priority(max(int(wanted), int(self.max_priority)))


def digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def load_keys(settings: AuthSettings) -> list[KeyEntry]:
    """The configured keys plus those of `key_file` (unique: checked by the settings)."""
    return [
        KeyEntry(
            digest=entry.digest(),
            tenant=entry.tenant,
            default_priority=Priority.parse(entry.default_priority),
            max_priority=Priority.parse(entry.max_priority),
        )
        for entry in settings.all_keys()
    ]


class KeyRing:
    """Lookup of a presented key among the configured digests.

    The presented key is hashed first and the *digest* looked up in a dict, then confirmed
    with `hmac.compare_digest`. Whatever the lookup's timing reveals is about SHA-256
    digests, which an attacker cannot steer toward a configured one (that would take a
    preimage), so nothing about the keys leaks, and the cost is the same for 1 or 10,000
    keys (see `benchmarks/auth_cost/`).
    """

    def __init__(self, entries: Sequence[KeyEntry]) -> None:
        self._by_digest = {entry.digest: entry for entry in entries}

    def __len__(self) -> int:
        return len(self._by_digest)

    def find(self, presented: bytes) -> KeyEntry | None:
        d = digest(presented)
        entry = self._by_digest.get(d)
        if entry is None or not hmac.compare_digest(entry.digest, d):
            return None
        return entry


def presented_key(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    """The client key from `Authorization: Bearer` or `x-api-key`, if any."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return None


def _unauthorized(message: str, code: str) -> GatewayError:
    return GatewayError(
        401, message, code, headers=[(b"www-authenticate", b'Bearer realm="kvgate"')]
    )


class FrontDoor:
    """Authenticates a request, tags it with its tenant and priority, then calls the app."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys
        self.refused = 0

    @property
    def enabled(self) -> bool:
        return len(self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send, app: ASGIApp) -> None:
        path: str = scope["path"]
        try:
            tenant = self._check(scope, path)
        except GatewayError as err:
            self.refused += 1
            await send_error(send, err)
            return
        if tenant is not None:
            scope[TENANT_SCOPE_KEY] = tenant
        await app(scope, receive, send)

    def _check(self, scope: Scope, path: str) -> str | None:
        """Raise for a refused request; return the tenant of an authenticated client."""
        if path in _OPEN_PATHS or is_admin_path(path):
            return None
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        key = presented_key(headers)
        if key is None:
            raise _unauthorized(
                "An API key is required: send `Authorization: Bearer <key>`.", "missing_api_key"
            )
        entry = self.keys.find(key)
        if entry is None:
            raise _unauthorized("The API key is not valid.", "invalid_api_key")
        scope["headers"] = _retag(headers, entry)
        return entry.tenant


def _retag(headers: Sequence[tuple[bytes, bytes]], entry: KeyEntry) -> list[tuple[bytes, bytes]]:
    """Drop the client's key; set the priority the key allows (an unknown one is kept, so
    the relay answers it with its usual 400)."""
    out: list[tuple[bytes, bytes]] = []
    asked: Priority | None = None
    for name, value in headers:
        if name in _CLIENT_KEY_HEADERS:
            continue
        if name == _PRIORITY_HEADER:
            try:
                asked = Priority.parse(value.decode("latin-1"))
            except ValueError:
                return [h for h in headers if h[0] not in _CLIENT_KEY_HEADERS]
            continue
        out.append((name, value))
    out.append((_PRIORITY_HEADER, entry.effective_priority(asked).name.lower().encode()))
    return out


class TenantCollector(Collector):
    """`kvgate_tenant_*` metrics, read from the ledger when `/metrics` is scraped."""

    def __init__(self, ledger: TenantLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        snap = self._ledger.snapshot()
        tokens = GaugeMetricFamily(
            "kvgate_tenant_in_flight_tokens", "KV tokens held by the tenant now.", labels=["tenant"]
        )
        requests = GaugeMetricFamily(
            "kvgate_tenant_in_flight_requests",
            "Requests the tenant has in flight.",
            labels=["tenant"],
        )
        refused = CounterMetricFamily(
            "kvgate_tenant_refused", "Requests refused by the tenant's limits.", labels=["tenant"]
        )
        for tenant, usage in snap.items():
            tokens.add_metric([tenant], usage["in_flight_tokens"])
            requests.add_metric([tenant], usage["in_flight_requests"])
            refused.add_metric([tenant], usage["refused_total"])
        yield tokens
        yield requests
        yield refused


def _limits(settings: TenantSettings) -> TenantLimits:
    return TenantLimits(settings.max_in_flight_tokens, settings.max_in_flight_requests)


def _budgets(settings: TenantSettings) -> BudgetLimits:
    return BudgetLimits(
        settings.tokens_per_minute, settings.tokens_per_day, settings.requests_per_minute
    )


@dataclass
class Security:
    """What the gateway needs from this package: the front door, the tenant ledger, the
    tenants' budgets and the admin check."""

    front: FrontDoor
    ledger: TenantLedger
    budgets: Budgets
    admin: AdminGuard

    @classmethod
    def from_config(cls, auth: AuthSettings, admin_token: str | None) -> Security:
        keys = KeyRing(load_keys(auth))
        ledger, budgets = TenantLedger(), Budgets()
        _apply_limits(ledger, budgets, auth)
        admin = AdminGuard(admin_token, views_open=len(keys) == 0)
        return cls(FrontDoor(keys), ledger, budgets, admin)

    @property
    def tenants(self) -> bool:
        """Are requests authenticated, and so charged to tenants?"""
        return self.front.enabled

    def update(self, auth: AuthSettings) -> bool:
        """Take the keys, tenant limits and budgets of a reloaded configuration (key files
        are read again). False, changing nothing, when keys would be switched on or off:
        that puts the front door on or off the request path, which only a restart does.
        Requests in flight keep their tenants' leases and reservations; a removed key is
        refused from the next request on; a budget keeps its level, within its new size."""
        keys = KeyRing(load_keys(auth))
        if (len(keys) > 0) != self.front.enabled:
            return False
        self.front.keys = keys
        _apply_limits(self.ledger, self.budgets, auth)
        return True


def _apply_limits(ledger: TenantLedger, budgets: Budgets, auth: AuthSettings) -> None:
    named, others = auth.tenant_limits()
    ledger.limits = {name: _limits(t) for name, t in named.items()}
    ledger.default_limits = _limits(others)
    budgets.limits = {name: _budgets(t) for name, t in named.items()}
    budgets.default_limits = _budgets(others)


def exposure_message(host: str, port: int, keys: int, admin: bool) -> tuple[int, str]:
    """The start-up log line that says who can reach this gateway (level, text)."""
    where = f"{host}:{port}"
    if keys:
        admin_text = "admin routes need server.admin_token" if admin else "admin routes closed"
        return logging.INFO, f"auth: {keys} API key(s) configured on {where}; {admin_text}"
    if _is_loopback(host):
        return (
            logging.INFO,
            f"auth: no API keys configured, so kvgate listens on loopback only ({where}); "
            "configure auth.keys before binding a public address",
        )
    readable = "" if admin else " and read /admin/state"
    return (
        logging.WARNING,
        f"auth: NO API KEYS configured and kvgate listens on {where}: anyone who can reach it "
        f"can send requests{readable}; configure auth.keys",
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
