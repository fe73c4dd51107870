"""Re-costing requests as soon as a better count of their prompts exists.

A request costed by the estimate (no tokenizer counted it, the engine's `/tokenize` did not
answer within its wait) may wait in the gateway's queue for seconds, and meanwhile a better
count arrives:

- the engine's late answer to its own `/tokenize` (`follow`): its basis takes the count,
  and, if it still waits, its waiter takes the new cost and the prompt's ids;
- a new ratio for its model (`ratio_moved`), learned from another request's count or the
  engine's `usage`: every waiter of that model still costed by the estimate is priced again.

The waiter keeps its place in the queue (`FlowController.recost`), and the queue is walked
again, since a smaller cost may start now. A request that started before its count arrived
(`started`) has its hold re-costed the same way (`AdmissionPolicy.recount`): it takes its
exact prompt, and, on an engine with prefix caching, its prompt's blocks, so the requests
after it share them (a burst's first requests, started on the estimate, would otherwise
leave their shared prefix counted whole by everyone after them).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from functools import partial

from kvgate.core.admission import Ticket
from kvgate.core.cost import CostBasis, CostEstimator, PromptCount
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.request import AdmissionRequest
from kvgate.gateway.relay.call import AccessRecord


class Recosting:
    """Waiters costed by the estimate, by model, and their re-costing; shared by all."""

    def __init__(self, flow: FlowController, estimator: CostEstimator) -> None:
        self.flow = flow
        self.estimator = estimator
        # model -> id(record) -> (waiter, record): waiters whose cost is an estimate.
        self._waiting: dict[str, dict[int, tuple[Waiter, AccessRecord]]] = {}
        # id(record) -> ticket: started requests whose count is still on its way.
        self._started: dict[int, Ticket] = {}
        self.recosted = 0

    def counted(self, record: AccessRecord, count: PromptCount) -> CostBasis | None:
        """Give the request's basis an exact count (learning the model's ratio from it);
        its waiter, if it waits, takes the new cost. The new basis, or None if the request
        has none."""
        basis = record.basis
        if basis is None or basis.exact:
            return basis
        moved = self.estimator.learn(basis, sum(count.per_prompt))
        counted = basis.with_count(count)
        record.basis = counted
        entry = self._waiting.get(basis.model, {}).pop(id(record), None)
        if entry is not None and entry[0].waiting:
            waiter = entry[0]
            self._apply([(waiter, self._repriced(waiter.request, counted))])
        ticket = self._started.pop(id(record), None)
        if ticket is not None and not ticket.released:
            self._apply([(ticket, self._repriced(ticket.request, counted))])
        if moved:
            self.ratio_moved(basis.model)
        return counted

    def follow(self, record: AccessRecord, late: asyncio.Task[PromptCount | None]) -> None:
        """Take the engine's late count when it comes."""
        late.add_done_callback(partial(self._late, record))

    def _late(self, record: AccessRecord, task: asyncio.Task[PromptCount | None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        count = task.result()
        if count is not None:
            self.counted(record, count)

    def started(self, record: AccessRecord, ticket: Ticket) -> None:
        """`ticket` started with the cost of `record.basis`: re-cost its hold when that
        improves (`ended` forgets it)."""
        basis = record.basis
        if basis is not None and not basis.exact and record.late_count is not None:
            self._started[id(record)] = ticket

    def ended(self, record: AccessRecord) -> None:
        self._started.pop(id(record), None)

    def watch(self, waiter: Waiter, record: AccessRecord) -> None:
        """`waiter` waits with the cost of `record.basis`: re-cost it when that improves."""
        basis = record.basis
        if basis is not None and not basis.exact:
            self._waiting.setdefault(basis.model, {})[id(record)] = (waiter, record)

    def unwatch(self, record: AccessRecord) -> None:
        basis = record.basis
        if basis is None:
            return
        waiting = self._waiting.get(basis.model)
        if waiting is not None:
            waiting.pop(id(record), None)
            if not waiting:
                del self._waiting[basis.model]

    def ratio_moved(self, model: str) -> None:
        """The model's ratio moved: price its estimated waiters again."""
        changes = []
        for waiter, record in self._waiting.get(model, {}).values():
            basis = record.basis
            if waiter.waiting and basis is not None:
                changes.append((waiter, self._repriced(waiter.request, basis)))
        self._apply(changes)

    def _repriced(self, request: AdmissionRequest, basis: CostBasis) -> AdmissionRequest:
        cost = self.estimator.price(basis)
        return dataclasses.replace(request, cost=cost, prompt_ids=basis.ids)

    def _apply(self, changes: Sequence[tuple[Waiter | Ticket, AdmissionRequest]]) -> None:
        if changes:
            self.recosted += len(changes)
            self.flow.recost(changes)
