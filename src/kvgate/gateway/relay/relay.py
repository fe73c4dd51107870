"""The relay: one proxied request's life, from its first header to its access-log line.

1. Read and cost the request (`intake.py`): 413, 400, 404 and 503 are answered from
   there, before admission; the result is the immutable `ClientRequest` and the core's
   immutable `AdmissionRequest`.
2. Inside one `CancelScope`, listening for the client's departure (`disconnect.py`), admit
   it (`admitting.py`: now, after waiting in the gateway's queue, or refused with the
   predicted wait as Retry-After; a client that leaves while waiting leaves the queue at
   once), send it to the granted backend and relay the answer (`streaming.py`: whole, or
   chunk by chunk for server-sent events). A connection refused or reset before any
   response byte is retried once on another backend.
3. Whoever cancels the scope (client gone, first-byte or idle timeout, shutdown drain), the
   upstream response is closed at once, which is how vLLM learns to abort; an engine with
   an abort API is told as well. The ticket is released exactly once (`admitting.py`).

Every request ends with one access-log line and its metrics, from its `AccessRecord`. A
failure after the response started ends the stream with an SSE `error` event; nothing
ever answers with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from kvgate.adapters.backend import Backend
from kvgate.core.admission import Outcome, Ticket
from kvgate.core.cost import CostEstimator
from kvgate.core.flow import FlowController
from kvgate.core.request import AdmissionRequest
from kvgate.gateway.http import disconnect
from kvgate.gateway.http.asgi import TENANT_SCOPE_KEY, Receive, Scope, Send
from kvgate.gateway.http.body import ClientGone
from kvgate.gateway.http.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    send_error,
)
from kvgate.gateway.http.h1client import H1Response
from kvgate.gateway.http.scope import CancelScope, ScopeCancelled
from kvgate.gateway.ops.telemetry import GatewayMetrics, log_access
from kvgate.gateway.relay.admitting import Admitter
from kvgate.gateway.relay.call import AccessRecord, Call, ClientRequest
from kvgate.gateway.relay.intake import Head, Intake, read_head
from kvgate.gateway.relay.ratelimit import rate_limit_headers
from kvgate.gateway.relay.recost import Recosting
from kvgate.gateway.relay.streaming import ResponseRelay, end_stream_with_error
from kvgate.gateway.relay.upstream import Upstream, close_quietly, request_headers
from kvgate.gateway.settings import LimitSettings
from kvgate.gateway.tokens.counting import PromptCounter
from kvgate.gateway.tokens.engine import EngineCounter
from kvgate.gateway.tokens.model import ModelTokenizer

log = logging.getLogger(__name__)

Spawn = Callable[[Awaitable[Any]], "asyncio.Task[Any]"]
#: One of `Intake`'s readers: the request read, checked and costed, or an error raised.
Read = Callable[
    [Head, Scope, Receive, AccessRecord], Awaitable[tuple[ClientRequest, AdmissionRequest]]
]

#: Client headers meant for kvgate only.
_DROP_REQUEST = frozenset({b"x-kvgate-priority", b"x-kvgate-max-wait-ms"})
#: What the client gets when the scope was cancelled for a reason other than its leaving.
_CANCELLED = {
    "first_byte_timeout": (504, "The upstream did not answer in time.", "upstream_timeout"),
    "read_timeout": (504, "The upstream stopped sending.", "upstream_timeout"),
    "shutdown": (503, "The gateway is shutting down.", "shutting_down"),
}


class Relay:
    """Everything a proxied request needs, shared by all requests of one gateway."""

    def __init__(
        self,
        upstream: Upstream,
        admission: FlowController,
        estimator: CostEstimator,
        metrics: GatewayMetrics,
        limits: LimitSettings,
        spawn: Spawn,
        tokenizers: Mapping[str, ModelTokenizer] | None = None,
    ) -> None:
        """`tokenizers`: the models' tokenizers, loaded (kvgate.gateway.tokens.files);
        models without one are counted by their vLLM engines' `/tokenize`, else estimated."""
        self.pool = upstream.pool
        self.upstream = upstream.settings
        self.flow = admission
        self.estimator = estimator
        self.metrics = metrics
        self.spawn = spawn
        self.counter = PromptCounter(tokenizers or {}, EngineCounter(upstream.pool), spawn)
        self.recosting = Recosting(admission, estimator)
        self.intake = Intake(
            upstream, estimator, limits.max_body_bytes, self.counter, self.recosting
        )
        self.admitter = Admitter(admission, metrics, upstream.pool, self._exchange, self.recosting)
        self.responses = ResponseRelay(
            admission, metrics, self.recosting, self.counter, upstream.settings.read_timeout_s
        )
        # Bound once: a bound method made per request is an allocation per request.
        self._read_completion: Read = self.intake.completion
        self._read_passthrough: Read = self.intake.passthrough
        self.active: set[CancelScope] = set()
        self.accepting = True
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def costs_snapshot(self) -> dict[str, Any]:
        """How prompts are counted: each model's tokenizer and learned characters per token,
        the engines' counts, and the waiters re-costed."""
        return {
            **self.counter.snapshot(),
            "chars_per_token": self.estimator.ratios.snapshot(),
            "recosted": self.recosting.recosted,
        }

    # ---- entry points ------------------------------------------------------------------------

    # Plain functions that hand back `_serve`'s coroutine: an `async def` wrapper would be
    # one more frame for every resumption of the request's task, i.e. for every SSE event.

    def completion(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """POST /v1/completions and /v1/chat/completions."""
        return self._serve(scope, receive, send, scope["path"], self._read_completion)

    def passthrough(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """Any other /v1/... path: forwarded unchanged to a backend serving its model."""
        return self._serve(scope, receive, send, "/v1/*", self._read_passthrough)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False when `timeout_s` passed first."""
        if self.metrics.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return self.metrics.in_flight == 0
        return True

    def cancel_all(self, reason: str) -> int:
        """Cancel every request in flight (shutdown after the drain timeout)."""
        scopes = list(self.active)
        for cscope in scopes:
            cscope.cancel(reason)
        return len(scopes)

    # ---- one request ----------------------------------------------------------------------------

    async def _serve(
        self, scope: Scope, receive: Receive, send: Send, route: str, read: Read
    ) -> None:
        head = read_head(scope["headers"])
        tenant = scope.get(TENANT_SCOPE_KEY) or ""
        record = AccessRecord(head.request_id, route, time.monotonic(), tenant)
        self.metrics.in_flight += 1
        try:
            if not self.accepting:
                raise GatewayError(
                    503,
                    "The gateway is shutting down.",
                    "shutting_down",
                    headers=[(b"retry-after", b"1")],
                )
            client, request = await read(head, scope, receive, record)
            await self._admit_and_relay(scope, receive, send, record, client, request)
        except GatewayError as err:
            record.status = err.status
            record.reason = err.code
            if record.ending == "done":
                record.ending = "rejected" if err.status in (429, 503) else "bad_request"
            record.first_byte_at = time.monotonic()
            err.headers += rate_limit_headers(self.flow.budgets, tenant, self.flow.clock.now())
            with contextlib.suppress(OSError):
                await send_error(send, err, record.request_id.encode())
        except ClientGone:
            record.status, record.ending = 499, "client_cancel"
        except Exception:
            # Never a traceback as a response: log it, answer 500 if nothing was sent yet.
            log.exception("request %s failed", record.request_id)
            record.ending = "internal_error"
            if record.first_byte_at is None:
                record.status = 500
                with contextlib.suppress(Exception):
                    await send_error(
                        send,
                        GatewayError(500, "Internal gateway error.", "internal_error"),
                        record.request_id.encode(),
                    )
        finally:
            self.metrics.in_flight -= 1
            if self._idle is not None and self.metrics.in_flight == 0:
                self._idle.set()
            self._finish(record)

    async def _admit_and_relay(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        record: AccessRecord,
        client: ClientRequest,
        request: AdmissionRequest,
    ) -> None:
        loop = self._loop or self._bind_loop()
        cscope = CancelScope(loop)
        call = Call(scope, send, client, record, cscope, loop)
        self.active.add(cscope)

        def client_gone() -> None:
            if not record.response_done:
                record.disconnected_at = time.monotonic()
                cscope.cancel("client_cancel")

        watching = disconnect.watch(scope, receive, client_gone, loop)
        try:
            with cscope:
                await self.admitter.run(call, request)
        except ScopeCancelled as stop:
            await self._after_cancel(send, record, stop.reason)
        finally:
            self.active.discard(cscope)
            await disconnect.stop_watching(watching)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        # Asked once: on Python 3.11 every `get_running_loop()` is a getpid() system call.
        self._loop = asyncio.get_running_loop()
        return self._loop

    async def _exchange(self, call: Call, backend: Backend, ticket: Ticket) -> Outcome:
        """One attempt on one backend; closes the upstream response on every early exit."""
        scope, record, client, cscope = call.scope, call.record, call.client, call.cscope
        path_qs = scope["path"] + (
            "?" + scope["query_string"].decode() if scope["query_string"] else ""
        )
        headers = request_headers(scope["headers"], record.request_id, _DROP_REQUEST)
        body = client.body
        id_field = backend.adapter.request_id_field
        if id_field is not None and client.data is not None:
            body = _with_field(body, id_field, record.request_id)
        response: H1Response | None = None
        clean = False
        cscope.deadline(self.upstream.first_byte_timeout_s, "first_byte_timeout")
        record.stage = "headers"
        try:
            response = await self.pool.open(backend, scope["method"], path_qs, headers, body)
            if response.status == 200 and response.content_type.startswith("text/event-stream"):
                outcome = await self.responses.stream(call, response, ticket)
            else:
                outcome = await self.responses.whole(call, response, ticket)
            clean = outcome is Outcome.DONE
            return outcome
        except UpstreamConnectError:
            raise
        except UpstreamError as exc:
            self.metrics.upstream_errors[backend.node_id, exc.kind] += 1
            record.ending = "upstream_error"
            raise GatewayError(502, f"Upstream error: {exc}.", "upstream_error") from None
        finally:
            cscope.clear_deadline()
            if clean and response is not None:
                response.release()
            else:
                close_quietly(response)
                self._propagated(record, cscope, backend)

    def _propagated(self, record: AccessRecord, cscope: CancelScope, backend: Backend) -> None:
        """The upstream request is closed: time it, and use the engine's abort API too."""
        if cscope.reason is None:
            return
        client_left = cscope.reason == "client_cancel"
        since = record.disconnected_at if client_left else cscope.cancelled_at
        if since is not None:
            self.metrics.observe_cancel(record.stage, time.monotonic() - since)
        if getattr(backend.adapter, "abort_supported", False):
            self.spawn(self._abort(backend, record.request_id, record.route))

    async def _abort(self, backend: Backend, request_id: str, route: str) -> None:
        try:
            await backend.adapter.abort(
                self.pool.session,
                backend.base_url,
                request_id,
                endpoint=route,
                headers=backend.auth_headers(),
            )
        except Exception:
            log.debug("abort of %s on %s failed", request_id, backend.node_id, exc_info=True)

    async def _after_cancel(self, send: Send, record: AccessRecord, reason: str) -> None:
        """Answer (if anyone is listening) after the scope was cancelled for `reason`."""
        if reason == "client_cancel":
            record.ending = "client_cancel"
            if record.first_byte_at is None:
                record.status = 499
            if record.streamed and record.completion_tokens is None:
                record.completion_tokens = max(0, record.events) or None
            if record.streamed and not record.saw_done:  # leaving after `[DONE]` loses nothing
                self.metrics.observe_client_gone_stream(
                    record.events - record.events_after_disconnect, record.events_after_disconnect
                )
            return
        record.ending = "shutdown" if reason == "shutdown" else "upstream_error"
        if reason != "shutdown":
            self.metrics.upstream_errors[record.backend, reason] += 1
        status, message, code = _CANCELLED.get(reason, (502, "Upstream error.", "upstream_error"))
        with contextlib.suppress(Exception):
            if record.first_byte_at is None:
                record.status = status
                await send_error(
                    send,
                    GatewayError(status, message, code, headers=[(b"retry-after", b"1")]),
                    record.request_id.encode(),
                )
            elif not record.response_done:
                await end_stream_with_error(send, record, status, message, code)

    # ---- the access line --------------------------------------------------------------------

    def _finish(self, record: AccessRecord) -> None:
        total = time.monotonic() - record.started
        first = record.first_token_at
        m = self.metrics
        m.requests[record.route, str(record.status), record.backend] += 1
        m.observe_duration(record.route, total)
        if record.first_byte_at is not None:
            m.observe_ttfb(record.route, record.first_byte_at - record.started)
        m.tenants.finished(
            record.tenant,
            refused=record.ending == "rejected",
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
        )
        log_access(
            {
                "id": record.request_id,
                "route": record.route,
                "tenant": record.tenant or None,
                "model": record.model,
                "backend": record.backend,
                "placement": record.placement,
                "status": record.status,
                "streamed": record.streamed,
                "priority": record.priority,
                "prompt_tokens": record.prompt_tokens,
                "completion_tokens": record.completion_tokens,
                "ttft_s": None if first is None else _us(first - record.started),
                "total_s": _us(total),
                "ending": record.ending,
                "reason": record.reason,
                "queue_s": None if record.queued_s is None else _us(record.queued_s),
                "retried": record.retried,
            }
        )


def _us(seconds: float) -> float:
    """Seconds to the microsecond, for the log: a truncation (~0.12 µs) where `round(x, 6)`
    goes through a decimal conversion (~0.32 µs, timeit, best of 5)."""
    return int(seconds * 1_000_000) / 1_000_000


def _with_field(body: bytes, name: str, value: str) -> bytes:
    """The JSON body with `name` set to `value`, e.g. SGLang's `rid`, which its abort API
    needs: the gateway's id replaces any the client sent, or the abort would miss."""
    data = orjson.loads(body)
    data[name] = value
    return orjson.dumps(data)
