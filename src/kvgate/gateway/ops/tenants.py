"""The tenants table: per tenant, what it has in flight and waiting, what kvgate refused it
and what the engines served it.

`TenantTally` counts, from each finished request's access record, the requests kvgate
refused itself (429 and 503) and the tokens the engines served (prompt and completion, as
their usage reported them). `tenant_table` joins those with the core's in-flight usage
per tenant and its queue into the `tenants` of `/admin/state`: `columns`, the figures in
display order with their headings, and `rows`, one per tenant. The dashboard and
`kvgate status` draw whatever `columns` lists, so a new figure is one entry in `COLUMNS`
and one key in the rows.

A gateway without API keys has one tenant, the empty name (`NO_KEY`: shown as "(no key)").
Tenants are the configured keys' names, so the tally stays as small as the key list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The table's figures, in display order: (key in each row, heading).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("in_flight_requests", "in flight"),
    ("in_flight_tokens", "in-flight tokens"),
    ("queued", "queued"),
    ("refused", "refused"),
    ("served_tokens", "served tokens"),
)
#: How the tenant of requests without a key (a gateway with none) is shown.
NO_KEY = "(no key)"


@dataclass(slots=True)
class _Counts:
    refused: int = 0
    served_tokens: int = 0


class TenantTally:
    """Refusals and served tokens per tenant, counted as requests end."""

    def __init__(self) -> None:
        self._counts: dict[str, _Counts] = {}

    def finished(
        self,
        tenant: str,
        *,
        refused: bool,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """One request of `tenant` ended: refused by kvgate, or with what it was served."""
        counts = self._counts.get(tenant)
        if counts is None:
            counts = self._counts[tenant] = _Counts()
        if refused:
            counts.refused += 1
        counts.served_tokens += (prompt_tokens or 0) + (completion_tokens or 0)

    def counts(self) -> dict[str, tuple[int, int]]:
        """(refused, served tokens) per tenant."""
        return {t: (c.refused, c.served_tokens) for t, c in self._counts.items()}


def tenant_table(
    tally: TenantTally,
    usage: Mapping[str, Mapping[str, Any]],
    queued: Mapping[str, int],
) -> dict[str, Any]:
    """The `tenants` of `/admin/state` from the tally, the core's usage per tenant (its
    `policy.tenants`) and the requests waiting per tenant (`policy.queue.tenants`)."""
    counts = tally.counts()
    rows = []
    for tenant in sorted({*counts, *usage, *queued}):
        held = usage.get(tenant, {})
        refused, served = counts.get(tenant, (0, 0))
        rows.append(
            {
                "tenant": tenant,
                "in_flight_requests": held.get("in_flight_requests", 0),
                "in_flight_tokens": held.get("in_flight_tokens", 0),
                "queued": queued.get(tenant, 0),
                "refused": refused,
                "served_tokens": served,
            }
        )
    return {"columns": [list(column) for column in COLUMNS], "rows": rows}
