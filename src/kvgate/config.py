"""kvgate's whole configuration: one YAML file, overridden by `KVGATE_*` variables.

Precedence, highest first: command-line flags, environment (`KVGATE_SERVER__PORT=9000`,
`KVGATE_ADMISSION__POLICY=seed`, `KVGATE_BACKENDS='[{"url": "..."}]'`), the YAML file,
the defaults below. Every key is documented by its `description`, from which the README's
reference table is generated (`kvgate config-doc`), so docs and code cannot drift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
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


def load_config(path: str | Path | None = None, **overrides: Any) -> KvgateConfig:
    """Read the YAML file (if any), apply `KVGATE_*`, then the caller's overrides.

    `overrides` use dotted keys for nested settings: `{"server.port": 9000}`.
    """
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level of a config file must be a mapping")
        data = loaded
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
