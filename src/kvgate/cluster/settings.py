"""The cluster's one setting: where the shared store is. Everything else has a fixed,
documented default (see `kvgate.cluster.sync`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvgate.cluster.urls import check_url


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        None,
        description="Redis shared by the gateway replicas (`redis://[:password@]host:port/db`,"
        " `rediss://` for TLS, `unix:///path?db=N`): they admit as one gateway. None: this"
        " process admits alone.",
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        return None if value is None or value == "" else check_url(value)
