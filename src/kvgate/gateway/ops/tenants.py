"""The tenants table: per tenant, what it has in flight and waiting, what kvgate refused it,
what the engines served it and what is left of its budget; and the budgets' metrics.

`TenantTally` counts, from each finished request's access record, the requests kvgate
refused itself (429 and 503) and the tokens the engines served (prompt and completion, as
their usage reported them). `tenant_table` joins those with the core's in-flight usage
per tenant, its queue and its budgets into the `tenants` of `/admin/state`: `columns`, the
figures in display order with their headings, and `rows`, one per tenant. The dashboard and
`kvgate status` draw whatever `columns` lists, so a new figure is one entry in `COLUMNS`
and one key in the rows. A budget's figures are those of the tenant's token budget with
the least left (per minute or per day): what is used of it (reserved or consumed) and
what is left, across replicas; a tenant without one shows none.

`BudgetCollector` exports every budget as `kvgate_tenant_budget_*` when `/metrics` is
scraped: its size, what is left of it, what this replica spent of it, and the requests it
refused.

A gateway without API keys has one tenant, the empty name (`NO_KEY`: shown as "(no key)").
Tenants are the configured keys' names, so the tally stays as small as the key list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: The table's figures, in display order: (key in each row, heading).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("in_flight_requests", "in flight"),
    ("in_flight_tokens", "in-flight tokens"),
    ("queued", "queued"),
    ("refused", "refused"),
    ("served_tokens", "served tokens"),
    ("budget_used", "budget used"),
    ("budget_left", "budget left"),
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
    budgets: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """The `tenants` of `/admin/state` from the tally, the core's usage per tenant (its
    `policy.tenants`), the requests waiting per tenant (`policy.queue.tenants`) and the
    budgets (`policy.budgets`)."""
    counts = tally.counts()
    rows = []
    for tenant in sorted({*counts, *usage, *queued, *budgets}):
        held = usage.get(tenant, {})
        refused, served = counts.get(tenant, (0, 0))
        window = _binding(budgets.get(tenant, {}))
        rows.append(
            {
                "tenant": tenant,
                "in_flight_requests": held.get("in_flight_requests", 0),
                "in_flight_tokens": held.get("in_flight_tokens", 0),
                "queued": queued.get(tenant, 0),
                "refused": refused,
                "served_tokens": served,
                "budget_used": None if window is None else window["limit"] - window["remaining"],
                "budget_left": None if window is None else window["remaining"],
            }
        )
    return {"columns": [list(column) for column in COLUMNS], "rows": rows}


def _binding(budget: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The tenant's token budget with the least left, if it has one."""
    windows = [
        window
        for name, window in (budget.get("windows") or {}).items()
        if name.startswith("tokens_")
    ]
    return min(windows, key=lambda w: w["remaining"]) if windows else None


class BudgetCollector(Collector):
    """`kvgate_tenant_budget_*`, read from the budgets' snapshot (`snapshot()`, the
    core's `Budgets.snapshot`) when `/metrics` is scraped."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant", "window"]
        limit = GaugeMetricFamily(
            "kvgate_tenant_budget_limit", "A tenant's budget (tokens or requests).", labels=labels
        )
        left = GaugeMetricFamily(
            "kvgate_tenant_budget_remaining",
            "What is left of the budget now, across replicas (not reserved, not consumed).",
            labels=labels,
        )
        spent = CounterMetricFamily(
            "kvgate_tenant_budget_spent",
            "What requests through this replica used of the budget (sum over replicas).",
            labels=labels,
        )
        refused = CounterMetricFamily(
            "kvgate_tenant_budget_refused",
            "Requests this replica refused for the tenant's budget (429 and 400).",
            labels=["tenant"],
        )
        for tenant, budget in self._snapshot().items():
            for window, figures in (budget.get("windows") or {}).items():
                limit.add_metric([tenant, window], figures["limit"])
                left.add_metric([tenant, window], figures["remaining"])
                spent.add_metric([tenant, window], figures["spent"])
            refused.add_metric([tenant], budget.get("refused_total", 0))
        yield limit
        yield left
        yield spent
        yield refused
