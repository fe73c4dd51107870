"""kvgate's whole configuration: one YAML file, overridden by `KVGATE_*` variables.

Precedence, highest first: command-line flags, environment
(`KVGATE_SERVER__LISTEN=0.0.0.0:9000`, `KVGATE_SERVER__LOG_FORMAT=json`,
`KVGATE_BACKENDS='[{"url": "..."}]'`), the YAML file, the defaults below. Every key is
documented by its `description`, from which the README's reference table is generated
(`kvgate config-doc`), so docs and code cannot drift. A key that is no longer a setting
(`RETIRED`) is refused with a word on where its value belongs.

Whatever is wrong with a configuration (an unreadable file, malformed YAML, a bad value)
is raised as one `ConfigError` whose message names the file position or the key, made
for a human reading a terminal: `kvgate serve` prints it and exits with status 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvgate.adapters.settings import BackendSettings, ScrapeSettings
from kvgate.cluster.settings import StoreSettings
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.gateway.security.settings import AuthSettings
from kvgate.gateway.settings import LimitSettings, ServerSettings, UpstreamSettings


class KvgateConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid"
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    backends: list[BackendSettings] = Field(
        default_factory=list, description="Engines behind the gateway."
    )
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)

    @field_validator("backends", mode="before")
    @classmethod
    def _bare_urls_are_vllm(cls, value: Any) -> Any:
        """`backends: [http://a:8000]` is shorthand for vLLM engines at those URLs."""
        if isinstance(value, list):
            return [{"url": v} if isinstance(v, str) else v for v in value]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats init kwargs, which carry the YAML file's content; the CLI
        # applies its flags on top afterwards (see `load_config`).
        return env_settings, init_settings


#: Keys whose values an error message never repeats.
_SECRET = re.compile(r"key|token|password", re.IGNORECASE)

#: Keys that are not settings, with what to write instead: a configuration that still
#: names one is told where its value belongs, not only that the key is unknown.
RETIRED: dict[str, str] = {
    "server.host": "give `server.listen: HOST:PORT` (e.g. 0.0.0.0:8080, [::]:8080), or --host",
    "server.port": "give `server.listen: HOST:PORT` (e.g. 0.0.0.0:8080, [::]:8080), or --port",
    "admission.seed": "a gateway seeds its randomness from the OS; the simulator and the"
    " benchmarks pass their own seed",
    "admission.failures_to_stale": "a node is dead after 10 hard scrape failures in a row"
    " (a constant); `admission.stale_after_s` sets how soon a silent node is out",
    "admission.retry_after_max_s": "Retry-After is the predicted wait, at most 30 s (a constant)",
    "admission.policy": "kvgate admits with its adaptive policy only; the baselines it is"
    " compared with are the benchmark's (`kvgate bench --policies`)",
    "admission.baseline": "the baselines' quotas are the benchmark's own options"
    " (`python -m kvgate.bench.serve --help`)",
    "auth.default_tenant_limits": 'give these limits as the entry "*" of auth.tenants'
    ' (every tenant not listed): auth: {tenants: {"*": {max_in_flight_tokens: ...}}}',
    "limits.client_timeout_s": "a client must send its whole request within 30 s (a constant)",
    "limits.max_connections": "kvgate takes 4096 open client connections at most (a constant)",
    "upstream.first_byte_timeout_s": "the response headers are waited for 10 times"
    " `upstream.read_timeout_s`",
}


class ConfigError(ValueError):
    """The configuration cannot be used; the message says where and why."""


def load_config(path: str | Path | None = None, **overrides: Any) -> KvgateConfig:
    """Read the YAML file (if any), apply `KVGATE_*`, then the caller's overrides.

    `overrides` use dotted keys for nested settings: `{"server.listen": "0.0.0.0:9000"}`. Raises
    ConfigError.
    """
    try:
        return _load(path, overrides)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None
    except SettingsError as exc:  # a KVGATE_* variable that does not parse
        raise ConfigError(f"{exc} (lists and sections are given as JSON)") from None


def describe(exc: ValidationError) -> str:
    """A validation error as `key: problem (got value)`, one per line when there are several."""
    problems = []
    for error in exc.errors(include_url=False):
        key = ".".join(str(part) for part in error["loc"]) or "configuration"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden" and key in RETIRED:
            message = f"not a setting: {RETIRED[key]}"
        value = error.get("input")
        shown = not (isinstance(value, dict | list) or value is None or _SECRET.search(key))
        got = f" (got {value!r})" if shown and repr(value) not in message else ""
        problems.append(f"{key}: {message}{got}")
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:" + "".join(f"\n  {p}" for p in problems)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level of a config file must be a mapping")
    return loaded


def _load(path: str | Path | None, overrides: dict[str, Any]) -> KvgateConfig:
    data = _read_yaml(path) if path is not None else {}
    config = KvgateConfig(**data)
    if not overrides:
        return config
    merged = config.model_dump()
    for dotted, value in overrides.items():
        if value is None:
            continue
        target = merged
        *parents, leaf = dotted.split(".")
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = value
    return _WithoutEnvironment(**merged)


class _WithoutEnvironment(KvgateConfig):
    """Re-validates a merged config without reading `KVGATE_*` again: flags beat the env."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)
