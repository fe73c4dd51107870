"""Token budgets per tenant: reserved before the call, settled after, held across replicas.

`book.Budgets` is what the flow controller asks; `bucket.Bucket` is one tenant's bucket for
one window (its docstring has the arithmetic). The budgets are given per tenant: tokens per
minute, tokens per day, requests per minute. Tokens are the prompt plus the output, as the
engine reports them.

**Across replicas.** Every replica keeps its own estimate of each bucket's level, and they
agree because they count the same consumption: each replica publishes, every sync, what it
has consumed of each bucket (a counter that only grows), its reservations, its *claim* (what
it may still reserve until its next view) and its level. A replica lowers its level by
what the others' counters grew since it last counted them, refills it at the bucket's rate,
and reserves only within its claim and what its level leaves beyond everyone's reservations
and claims. Claims are split like a node's slack (`kvgate.core.replicas.peers`): the
replica whose waiting head is oldest first, then by what each has waiting, the rest in
equal parts. No request waits for the store.

Why the bucket is never overspent, however many replicas: (1) a replica's level only
counts consumption that really happened, perhaps late, so it is never above the level the
cluster would have if that consumption had been seen at once; (2) what happened and was not
counted yet is within the claims the replica has seen (each replica keeps to its claim from
the moment it publishes it); (3) the store's exchange is atomic, so the replica that
exchanged last saw every replica's current claim, and its own allowance leaves room for
all of them. Everything else errs on the side of counting more: a replica that leaves the
store is taken to have used all it held and claimed, and a replica whose view is old to
have taken its part of the refill since (what an isolated replica does).

**Joining.** A bucket new to a replica among others (a new replica, or a tenant's first
request there) learns its level at the next exchange from a replica that publishes it:
that replica's level, refilled since, less what the live replicas consumed beyond what it
counted (its view says whose consumption its count sums). A bucket no live replica
publishes is new to the cluster and starts full. So the budgets live in the replicas, not
in the store: a store restarted empty forgets nothing of them, and a whole cluster
restarted starts its buckets full.

**Isolated** from the store, a replica keeps what is left of its claim, cut to 1/N of the
window beyond its reservations, and adds 1/N of the refill up to 1/N of the window, until
views flow again. A replica cut off alone while the others still exchange is taken to have
departed after its membership expires; from then on what it takes from its 1/N is counted
only when it comes back (the others have no way to tell it from a dead one).
"""

from kvgate.core.budgets.book import BudgetLimits, BudgetRefusal, Budgets, RateStatus, Reservation
from kvgate.core.budgets.bucket import WINDOWS, Bucket, BudgetView, Window

__all__ = [
    "WINDOWS",
    "Bucket",
    "BudgetLimits",
    "BudgetRefusal",
    "BudgetView",
    "Budgets",
    "RateStatus",
    "Reservation",
    "Window",
]
