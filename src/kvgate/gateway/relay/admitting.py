"""Admitting a request: the core's decision, the wait for it, and the one retry.

`Admitter.run` hands the request's `AdmissionRequest` to the core's `FlowController`,
which admits it now, refuses it now, or gives back a `Waiter`: the request then waits in
the gateway's queue until the core grants it room through `Waiter.notify`, until the
waiter's deadline (the core's answer is then a refusal with the predicted wait), or until
its client leaves (the request's cancel scope is cancelled: it leaves the queue at once,
and a grant that raced the departure is given back). A refusal becomes the OpenAI error
with `Retry-After` (`rejection`).

The granted ticket's backend then gets the request (the exchange, given by the relay), and the
ticket is released exactly once, in a `finally`, with the exchange's outcome and what the
request used of its tenant's budgets (`ratelimit.tokens_used`; nothing when it never
reached an engine). A
connection refused or reset before any response byte is retried once on another backend:
the first ticket released, a copy of the request (`dataclasses.replace`) naming only the
nodes not yet tried is admitted anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable

from kvgate.adapters.backend import Backend
from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.request import AdmissionRequest
from kvgate.gateway.http.errors import GatewayError, UpstreamConnectError, UpstreamError
from kvgate.gateway.ops.telemetry import GatewayMetrics
from kvgate.gateway.relay.call import Call
from kvgate.gateway.relay.ratelimit import tokens_used
from kvgate.gateway.relay.recost import Recosting
from kvgate.gateway.relay.upstream import UpstreamPool

#: One attempt on the granted backend: the relay's exchange, returning how it ended.
Exchange = Callable[[Call, Backend, Ticket], Awaitable[Outcome]]

#: How a ticket ends when its exchange is cancelled, by the cancel scope's reason.
_OUTCOMES = {
    "client_cancel": Outcome.CLIENT_CANCEL,
    "shutdown": Outcome.SHUTDOWN,
    "first_byte_timeout": Outcome.UPSTREAM_ERROR,
    "read_timeout": Outcome.UPSTREAM_ERROR,
}


class Admitter:
    """Admission and retry for the relay's requests; shared by all of them."""

    def __init__(
        self,
        flow: FlowController,
        metrics: GatewayMetrics,
        pool: UpstreamPool,
        exchange: Exchange,
        recosting: Recosting,
    ) -> None:
        self.flow = flow
        self.metrics = metrics
        self.pool = pool
        self.exchange = exchange
        self.recosting = recosting

    async def run(self, call: Call, request: AdmissionRequest) -> None:
        """Admit `request` and run the exchange on the granted backend, retried once on
        another after a connect failure; raises the refusal or the final 503."""
        record, cscope, flow = call.record, call.cscope, self.flow
        nodes = request.candidates
        tried: list[str] = []
        last_error: UpstreamError | None = None
        if record.late_count is not None:
            self.recosting.follow(record, record.late_count)
        for attempt in range(2):
            # After an await: a reload may have removed a node since the model was resolved.
            backends = self.pool.backends
            candidates = tuple(n for n in nodes if n not in tried and n in backends)
            if attempt and not candidates:
                break
            if candidates != request.candidates:
                request = dataclasses.replace(request, candidates=candidates)
            ticket = await self._admit(call, request, after_failure=attempt > 0)
            request = ticket.request  # re-costed, perhaps, while it waited
            self.recosting.started(record, ticket)
            backend = self.pool.backends.get(ticket.node_id)
            outcome = Outcome.UPSTREAM_ERROR
            reached = True  # the engine got the request (a connect failure: it did not)
            try:
                if backend is None:  # removed by a reload while the request waited
                    raise UpstreamConnectError("the backend was removed", "removed")
                record.backend = backend.node_id
                record.placement = ticket.route or None
                outcome = await self.exchange(call, backend, ticket)
                return
            except UpstreamConnectError as exc:
                reached = False
                self.metrics.upstream_errors[ticket.node_id, exc.kind] += 1
                tried.append(ticket.node_id)
                last_error = exc
                record.retried = attempt == 0
                if attempt == 0:
                    self.metrics.retries += 1
            except asyncio.CancelledError:
                outcome = _OUTCOMES.get(cscope.reason or "", Outcome.CLIENT_CANCEL)
                raise
            finally:
                if record.completion_tokens is not None and not record.streamed:
                    flow.on_tokens(ticket, record.completion_tokens)
                used = tokens_used(record, request) if reached else 0
                flow.release(ticket, outcome, used_tokens=used)
                self.recosting.ended(record)
        record.ending = "upstream_error"
        message = str(last_error) if last_error else "No other backend to retry on."
        raise GatewayError(
            503,
            f"Upstream unavailable: {message}.",
            "upstream_unavailable",
            headers=[(b"retry-after", b"1")],
        )

    async def _admit(self, call: Call, request: AdmissionRequest, after_failure: bool) -> Ticket:
        """The flow controller's answer: a ticket now, after waiting, or a refusal raised."""
        record = call.record
        decision = self.flow.submit(request)
        if isinstance(decision, Waiter):
            decision = await self._wait(call, decision)
        if isinstance(decision, Reject):
            self.metrics.admissions["rejected", record.priority or "-", decision.reason] += 1
            if decision.status != 400:  # a 400 tells no Retry-After: nothing to retry
                self.metrics.observe_retry_after(decision.retry_after_s)
            record.reason = decision.reason
            raise rejection(decision, after_failure=after_failure)
        self.metrics.admissions["admitted", record.priority or "-", "admitted"] += 1
        return decision.ticket

    async def _wait(self, call: Call, waiter: Waiter) -> Decision:
        """Wait for the core's decision, until the waiter's deadline.

        The core calls `notify` from inside whichever call freed the room. A client that
        leaves (the scope is cancelled) leaves the queue; if the grant raced its departure,
        the granted ticket is given back at once, so nothing stays held for nobody.
        """
        flow = self.flow
        future: asyncio.Future[Decision] = call.loop.create_future()

        def notify(decision: Decision) -> None:
            if not future.done():
                future.set_result(decision)

        waiter.notify = notify
        record = call.record
        record.stage = "queued"
        self.recosting.watch(waiter, record)
        started = time.monotonic()
        remaining = waiter.deadline - flow.clock.now()
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await future
        except TimeoutError:
            return flow.expire(waiter)
        except BaseException:
            flow.cancel(waiter)
            granted = waiter.decision
            if isinstance(granted, Admit):
                flow.release(granted.ticket, Outcome.CLIENT_CANCEL, used_tokens=0)
            raise
        finally:
            self.recosting.unwatch(record)
            record.queued_s = time.monotonic() - started
            self.metrics.observe_queue_wait(record.priority or "-", record.queued_s)


def rejection(decision: Reject, *, after_failure: bool) -> GatewayError:
    """The core's refusal as an OpenAI error whose code is the refusal's reason, with
    Retry-After (whole seconds, at least 1).

    A refusal of the retry, after a failed attempt, is a 503, unless the request can
    never be served as sent (400: nothing to retry, so no Retry-After).
    """
    status = 503 if after_failure and decision.status != 400 else decision.status
    if status == 400:
        return GatewayError(400, decision.message, decision.reason, param="max_tokens")
    retry_s = max(0.0, decision.retry_after_s)
    headers = [
        (b"retry-after", str(max(1, math.ceil(retry_s))).encode()),
        (b"retry-after-ms", str(max(1, round(retry_s * 1000))).encode()),
    ]
    return GatewayError(status, decision.message, decision.reason, headers=headers)
