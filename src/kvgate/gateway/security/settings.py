"""Settings of client authentication and tenants (the `auth:` section of the config).

Keys are optional. With none configured kvgate serves anyone who can reach it, which is
why its default listening address is 127.0.0.1. With keys, every `/v1/...` request needs
one (`Authorization: Bearer <key>` as the OpenAI SDKs send it, or `x-api-key`), and the
admin routes need `server.admin_token`.

A key can be written in clear (`key`) or as the hex SHA-256 of the key (`key_sha256`), so
that a config file that leaks does not leak usable keys. Keys may also live in a separate
file (`auth.key_file`, YAML or JSON: a list of the same entries, or `{"keys": [...]}`), so
that the main config can be shared and the secrets kept with tighter permissions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.core.request import Priority

_PRIORITY_NAMES = ("critical", "standard", "sheddable")

#: The name in `auth.tenants` whose limits apply to every tenant not listed by name.
ANY_TENANT = "*"


def _priority(name: str) -> Priority:
    return Priority.parse(name)


class ApiKeySettings(BaseModel):
    """One client key: who it belongs to and how important its requests may be."""

    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(
        None, min_length=16, repr=False, description="The key in clear (at least 16 characters)."
    )
    key_sha256: str | None = Field(
        None,
        pattern=r"^[0-9a-fA-F]{64}$",
        repr=False,
        description="Hex SHA-256 of the key, instead of `key`.",
    )
    tenant: str = Field(
        min_length=1, max_length=128, description="Tenant the key belongs to (limits, metrics)."
    )
    default_priority: str = Field(
        "standard", description="Priority of requests that send no `X-Kvgate-Priority`."
    )
    max_priority: str = Field(
        "standard",
        description="Most important priority this key may ask for; higher asks are lowered to it.",
    )

    @model_validator(mode="after")
    def _check(self) -> ApiKeySettings:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of `key` and `key_sha256`")
        if self.tenant == ANY_TENANT:
            raise ValueError(
                f"`{ANY_TENANT}` is not a tenant name: in auth.tenants it stands for every"
                " tenant not listed"
            )
        for field in ("default_priority", "max_priority"):
            value = getattr(self, field)
            if value.strip().lower() not in _PRIORITY_NAMES:
                raise ValueError(f"{field} must be one of {', '.join(_PRIORITY_NAMES)}")
        if _priority(self.default_priority) < _priority(self.max_priority):
            raise ValueError("default_priority must not be above max_priority")
        return self

    def digest(self) -> bytes:
        """SHA-256 of the key: what kvgate keeps and compares."""
        if self.key is not None:
            return hashlib.sha256(self.key.encode()).digest()
        return bytes.fromhex(self.key_sha256 or "")


class TenantSettings(BaseModel):
    """Limits and budgets of one tenant, over all its keys (and all replicas)."""

    model_config = ConfigDict(extra="forbid")

    max_in_flight_tokens: int | None = Field(
        None, gt=0, description="KV tokens (prompt + max_tokens) the tenant may hold at once."
    )
    max_in_flight_requests: int | None = Field(
        None, gt=0, description="Requests the tenant may have in flight at once."
    )
    tokens_per_minute: int | None = Field(
        None, gt=0, description="Tokens (prompt + output, as the engine counts them) a minute."
    )
    tokens_per_day: int | None = Field(None, gt=0, description="Tokens a day.")
    requests_per_minute: int | None = Field(None, gt=0, description="Requests a minute.")


class AuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKeySettings] = Field(
        default_factory=list, description="Client API keys (none: no authentication)."
    )
    key_file: str | None = Field(
        None,
        description="YAML/JSON file with more keys (same fields), read at start and reload.",
    )
    tenants: dict[str, TenantSettings] = Field(
        default_factory=dict,
        description="Per-tenant limits (`max_in_flight_tokens`: KV tokens, prompt +"
        " max_tokens, held at once; `max_in_flight_requests`) and budgets, shared by all"
        " replicas (`tokens_per_minute`, `tokens_per_day`: prompt + output as the engine"
        " counts them; `requests_per_minute`), by tenant name; the entry"
        ' `"*"` applies to every tenant not listed (default: no limits).',
    )

    def tenant_limits(self) -> tuple[dict[str, TenantSettings], TenantSettings]:
        """The limits of the tenants listed by name, and those of every other tenant."""
        named = {name: t for name, t in self.tenants.items() if name != ANY_TENANT}
        return named, self.tenants.get(ANY_TENANT, TenantSettings())

    def all_keys(self) -> list[ApiKeySettings]:
        """`keys` plus the entries of `key_file` (read now)."""
        entries = list(self.keys)
        if self.key_file:
            entries.extend(read_key_file(Path(self.key_file)))
        return entries

    @model_validator(mode="after")
    def _keys_are_unique(self) -> AuthSettings:
        """Read the key file at load time, so a bad one is a configuration error."""
        seen: set[bytes] = set()
        for entry in self.all_keys():
            digest = entry.digest()
            if digest in seen:
                raise ValueError(f"a key of tenant {entry.tenant!r} is configured twice")
            seen.add(digest)
        return self


def read_key_file(path: Path) -> list[ApiKeySettings]:
    """Keys from a YAML/JSON file: a list of key entries, or `{keys: [...]}`."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"auth.key_file {path}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("keys", [])
    if not isinstance(data, list):
        raise ValueError(f"auth.key_file {path}: expected a list of keys or {{keys: [...]}}")
    return [ApiKeySettings.model_validate(item) for item in data]
