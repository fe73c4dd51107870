"""The parts of a request that admission cares about: its cost and its priority."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Priority(enum.IntEnum):
    """Lower value = more important. Shed from the bottom (highest value) up."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2

    @classmethod
    def parse(cls, text: str | None) -> Priority:
        """Parse an `X-Kvgate-Priority` header value; raises ValueError when unknown."""
        if not text:
            return cls.STANDARD
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown priority {text!r}: expected critical, standard or sheddable"
            ) from None


@dataclass(frozen=True, slots=True)
class RequestCost:
    """The KV-cache tokens a request may hold at its peak: prompt plus all it may generate."""

    prompt_tokens: int
    max_output_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_output_tokens
