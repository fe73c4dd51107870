"""Flow control: the gateway's queue, its order and its wake-ups, in the pure core.

`FlowController` is what the shell and the simulator hold. See `controller` for the
design, `queue` for the order (priority bands, tenant fairness, FIFO), `fairness` for the
two ways of sharing a band between tenants and `waits` for the predictions a request is
queued or refused on. Its side of the replica exchange is
`kvgate.core.replicas.exchange`; the policy it asks is `kvgate.core.admission.AdmissionPolicy`.
"""

from kvgate.core.flow.controller import FlowController
from kvgate.core.flow.fairness import ArrivalOrder, Fairness, TokenFairness
from kvgate.core.flow.queue import Waiter, WaitQueue, WaitState

__all__ = [
    "ArrivalOrder",
    "Fairness",
    "FlowController",
    "TokenFairness",
    "WaitQueue",
    "WaitState",
    "Waiter",
]
