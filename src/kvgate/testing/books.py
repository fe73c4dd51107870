"""Sums over the core's books that only tests ask for: what admission never needs as one
figure, but a test checks to prove that the books add up (and return to zero)."""

from __future__ import annotations

from kvgate.core.nodes import NodeState
from kvgate.core.plan.envelope import Envelope
from kvgate.core.policies.base import BasePolicy
from kvgate.core.tenants import TenantLedger


def ledger_totals(ledger: TenantLedger) -> tuple[int, int]:
    """(tokens, requests) every tenant holds through this replica, summed."""
    usage = ledger._usage.values()
    return sum(u.tokens for u in usage), sum(u.requests for u in usage)


def full_reserved_on(policy: BasePolicy, node_id: str) -> int:
    """P + M + ovh summed over the live tickets on `node_id`."""
    book = policy.holds.books.get(node_id)
    return book.full if book else 0


def upper_tokens(policy: BasePolicy, node: NodeState) -> float | None:
    """`bound`: the node's reported used tokens plus every hold run to its cap (None when
    its capacity is unknown)."""
    if node.cap is None:
        return None
    return node.used + policy.holds.reserved_on(node.node_id)


def envelope_upper_bound(envelope: Envelope) -> float:
    """Usage if every request grew to its end and none ended: an O(n) bound of `peak`."""
    return envelope.base + sum(envelope._steps)
