"""The relay: admit, pick a backend, forward, stream back, and stop the engine when asked.

One request's life:

1. Read the body (413 past the limit), parse it once with orjson (400 on anything
   malformed), resolve the model (404 when no backend serves it), estimate its KV cost, and
   build the request's `Call`: everything its later steps need, in one object.
2. Inside one `CancelScope`, listening for the client's departure (`disconnect.py`), hand
   the request to the core's flow controller: it starts now, waits in the gateway's queue
   until the core grants it room (or refuses it: 429 with the predicted wait as
   Retry-After), or is refused at once (429/503/400). A client that leaves while waiting
   leaves the queue at once. Then send the request to the granted backend and relay its
   answer: whole for ordinary responses,
   chunk by chunk for server-sent events. A stream is spliced when both ends allow it
   (`splice.py`: each read is written to the client from the upstream socket's callback),
   else relayed by a loop that awaits `send()` before the next read. Either way a slow
   client slows the upstream read and memory stays bounded.
3. Whoever cancels the scope (client gone, first-byte or idle timeout, shutdown drain), the
   upstream response is closed at once, which is how vLLM learns to abort; an engine with
   an abort API is told as well. The ticket is released exactly once in a `finally`.

A connection refused or reset before any response byte is retried once on another backend
(the first ticket released, a new one admitted). A failure after the response started
ends the stream with an SSE `error` event; nothing ever answers with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvgate.adapters.backend import Backend
from kvgate.core.admission import Admit, Decision, Outcome, Reject, Ticket
from kvgate.core.cost import CostEstimator
from kvgate.core.flow import FlowController, Waiter
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.gateway.http import disconnect, splice
from kvgate.gateway.http.asgi import TENANT_SCOPE_KEY, Receive, Scope, Send
from kvgate.gateway.http.errors import (
    GatewayError,
    UpstreamConnectError,
    UpstreamError,
    send_error,
    sse_error_event,
)
from kvgate.gateway.http.h1client import H1Response
from kvgate.gateway.http.scope import CancelScope, ScopeCancelled
from kvgate.gateway.ops.telemetry import GatewayMetrics, log_access
from kvgate.gateway.relay.context import check_context
from kvgate.gateway.relay.upstream import (
    HOP_BY_HOP,
    ModelCatalog,
    UpstreamPool,
    close_quietly,
    request_headers,
)
from kvgate.gateway.settings import LimitSettings, UpstreamSettings

log = logging.getLogger(__name__)

Spawn = Callable[[Awaitable[Any]], "asyncio.Task[Any]"]

#: Upstream response headers the server or this relay sets itself.
_DROP_RESPONSE = HOP_BY_HOP | {b"x-request-id", b"date", b"server"}
#: Client headers meant for kvgate only.
_DROP_REQUEST = frozenset({b"x-kvgate-priority", b"x-kvgate-max-wait-ms"})
_EVENT_STREAM = b"text/event-stream"
_DATA = b"data:"
_DONE = b"[DONE]"
_PROMPT_TOKENS = b'"prompt_tokens"'


class ClientGone(Exception):
    """The client disconnected before the request was even read."""


@dataclass(slots=True)
class Exchange:
    """What the access log and the metrics need to know about one request."""

    request_id: str
    route: str
    started: float
    backend: str = "-"
    status: int = 0
    streamed: bool = False
    ending: str = "done"
    model: str | None = None
    priority: str | None = None
    stage: str = "read"
    first_byte_at: float | None = None
    first_token_at: float | None = None
    last_chunk_at: float = 0.0
    disconnected_at: float | None = None
    response_done: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    retried: bool = False
    estimated_prompt: int = 0
    queued_s: float | None = None  # time spent waiting in the gateway's queue
    reason: str | None = None  # why the gateway answered an error itself
    # SSE data events relayed so far (a stream's tokens, or more when an engine merges
    # several into one event), and those received after the client's disconnect was noticed.
    events: int = 0
    events_after_disconnect: int = 0
    saw_done: bool = False  # the stream's `data: [DONE]` was relayed


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    stream: bool
    max_tokens: int | None
    data: dict[str, Any]

    @property
    def exact_output(self) -> bool:
        """Runs to exactly `max_tokens`: end-of-sequence ignored (a vLLM/SGLang extension)."""
        return self.max_tokens is not None and self.data.get("ignore_eos") is True


@dataclass(slots=True)
class Call:
    """One request's passage through the relay: what each step needs, in one place."""

    scope: Scope
    receive: Receive
    send: Send
    ex: Exchange
    body: bytes = b""
    parsed: ParsedRequest | None = None
    request: AdmissionRequest = field(
        default_factory=lambda: AdmissionRequest("", RequestCost(0, 0))
    )
    cscope: CancelScope | None = None


class Relay:
    """Everything a proxied request needs, shared by all requests of one gateway."""

    def __init__(
        self,
        pool: UpstreamPool,
        catalog: ModelCatalog,
        admission: FlowController,
        estimator: CostEstimator,
        metrics: GatewayMetrics,
        upstream: UpstreamSettings,
        limits: LimitSettings,
        spawn: Spawn,
    ) -> None:
        self.pool = pool
        self.catalog = catalog
        self.admission = admission
        self.estimator = estimator
        self.metrics = metrics
        self.upstream = upstream
        self.limits = limits
        self.spawn = spawn
        self.active: set[CancelScope] = set()
        self.accepting = True
        self._idle: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- entry points ------------------------------------------------------------------------

    # Plain functions that hand back `_serve`'s coroutine: an `async def` wrapper would be
    # one more frame for every resumption of the request's task, i.e. for every SSE event.

    def completion(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """POST /v1/completions and /v1/chat/completions."""
        return self._serve(scope, receive, send, scope["path"], self._completion_plan)

    def passthrough(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        """Any other /v1/... path: forwarded unchanged to a backend serving its model."""
        return self._serve(scope, receive, send, "/v1/*", self._passthrough_plan)

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
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: str,
        plan: Callable[[Call], Awaitable[None]],
    ) -> None:
        fields = _request_fields(scope["headers"])
        ex = Exchange(request_id=fields.request_id, route=route, started=time.monotonic())
        call = Call(scope, receive, send, ex)
        self.metrics.in_flight += 1
        try:
            if not self.accepting:
                raise GatewayError(
                    503,
                    "The gateway is shutting down.",
                    "shutting_down",
                    headers=[(b"retry-after", b"1")],
                )
            call.body = await _read_body(receive, self.limits.max_body_bytes, fields.declared)
            call.request = fields.admission_request(scope)
            ex.priority = call.request.priority.label
            await plan(call)
            await self._admit_and_relay(call)
        except GatewayError as err:
            ex.status = err.status
            ex.reason = _reason(err)
            if ex.ending == "done":
                ex.ending = "rejected" if err.status in (429, 503) else "bad_request"
            ex.first_byte_at = time.monotonic()
            with contextlib.suppress(OSError):
                await send_error(send, err, ex.request_id.encode())
        except ClientGone:
            ex.status, ex.ending = 499, "client_cancel"
        except Exception:
            # Never a traceback as a response: log it, answer 500 if nothing was sent yet.
            log.exception("request %s failed", ex.request_id)
            ex.ending = "internal_error"
            if ex.first_byte_at is None:
                ex.status = 500
                with contextlib.suppress(Exception):
                    await send_error(
                        send,
                        GatewayError(500, "Internal gateway error.", "internal_error"),
                        ex.request_id.encode(),
                    )
        finally:
            self.metrics.in_flight -= 1
            if self._idle is not None and self.metrics.in_flight == 0:
                self._idle.set()
            self._finish(ex)

    def _with_default_max_tokens(self, parsed: ParsedRequest, limit: int | None) -> bytes:
        """The body with the output cap admission assumed, made explicit (no larger than the
        model's context, which an engine would refuse).

        Without it the engine may generate up to its context limit, past what was planned.
        Re-encoding happens only for requests that omit `max_tokens`.
        """
        cap = self.estimator.settings.default_max_tokens
        if limit is not None:
            cap = min(cap, limit)
        return orjson.dumps({**parsed.data, "max_tokens": cap})

    async def _completion_plan(self, call: Call) -> None:
        parsed = parse_completion(call.body)
        call.parsed = parsed
        ex = call.ex
        ex.model = parsed.model
        if "messages" not in parsed.data and "prompt" not in parsed.data:
            field = "messages" if ex.route.endswith("/chat/completions") else "prompt"
            raise _bad(f"`{field}` is required.", field)
        try:
            cost = self.estimator.estimate(parsed.model, parsed.data)
        except ValueError as exc:
            raise _bad(f"{exc}.", getattr(exc, "param", None)) from None
        ex.estimated_prompt = cost.prompt_tokens
        request = call.request
        request.cost = cost
        request.model = parsed.model
        request.exact_output = parsed.exact_output
        request.candidates = await self._nodes_for(parsed.model)
        limit = self.catalog.max_model_len(parsed.model)
        check_context(limit, parsed.model, parsed.data, cost, self.estimator)
        if limit is not None and cost.total > limit:
            # The engine stops generating at its context length, so no request holds more.
            # The prompt is over-estimated by design: leave room for it to be that much
            # shorter, which leaves more room to generate.
            shortest = int(cost.prompt_tokens / self.estimator.tuning.prompt_safety_factor)
            output = min(cost.max_output_tokens, max(0, limit - shortest))
            request.cost = RequestCost(cost.prompt_tokens, output, cost.prompt_floor)
        if parsed.max_tokens is None:
            call.body = self._with_default_max_tokens(parsed, limit)

    async def _passthrough_plan(self, call: Call) -> None:
        model = _model_of(call.body)
        request = call.request
        if model is None:
            request.candidates = tuple(self.pool.backends)
        else:
            call.ex.model = request.model = model
            request.candidates = await self._nodes_for(model)
        # Embeddings and the like hold KV only for their input, roughly a token per 4 bytes.
        request.cost = RequestCost(prompt_tokens=len(call.body) // 4, max_output_tokens=0)

    async def _nodes_for(self, model: str) -> tuple[str, ...]:
        nodes = await self.catalog.resolve(model)
        if nodes is not None:
            return nodes
        if not self.catalog.known:
            raise GatewayError(
                503,
                "No backend is reachable to serve this request.",
                "no_backend",
                headers=[(b"retry-after", b"1"), (b"x-kvgate-reason", b"no_backend")],
            )
        raise GatewayError(
            404, f"The model `{model}` does not exist.", "model_not_found", param="model"
        )

    # ---- admission, retry, cancellation ------------------------------------------------------

    async def _admit_and_relay(self, call: Call) -> None:
        loop = self._loop or self._bind_loop()
        cscope = call.cscope = CancelScope(loop)
        self.active.add(cscope)
        ex = call.ex

        def client_gone() -> None:
            if not ex.response_done:
                ex.disconnected_at = time.monotonic()
                cscope.cancel("client_cancel")

        watching = disconnect.watch(call.scope, call.receive, client_gone, loop)
        try:
            with cscope:
                await self._attempts(call)
        except ScopeCancelled as stop:
            await self._after_cancel(call.send, ex, stop.reason)
        finally:
            self.active.discard(cscope)
            await disconnect.stop_watching(watching)

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        # Asked once: on Python 3.11 every `get_running_loop()` is a getpid() system call.
        self._loop = asyncio.get_running_loop()
        return self._loop

    async def _attempts(self, call: Call) -> None:
        ex, cscope = call.ex, call.cscope
        assert cscope is not None
        nodes = call.request.candidates
        tried: list[str] = []
        last_error: UpstreamError | None = None
        for attempt in range(2):
            # The retry comes after an await: a reload may have removed a node since.
            backends = self.pool.backends
            candidates = tuple(n for n in nodes if n not in tried and n in backends)
            if attempt and not candidates:
                break
            call.request.candidates = candidates
            ticket = await self._admit(call, after_failure=attempt > 0)
            backend = self.pool.backends.get(ticket.node_id)
            outcome = Outcome.UPSTREAM_ERROR
            try:
                if backend is None:  # removed by a reload while the request waited
                    raise UpstreamConnectError("the backend was removed", "removed")
                ex.backend = backend.node_id
                outcome = await self._exchange(call, backend, ticket)
                return
            except UpstreamConnectError as exc:
                self.metrics.upstream_errors[ticket.node_id, exc.kind] += 1
                tried.append(ticket.node_id)
                last_error = exc
                ex.retried = attempt == 0
                if attempt == 0:
                    self.metrics.retries += 1
            except asyncio.CancelledError:
                outcome = _OUTCOMES.get(cscope.reason or "", Outcome.CLIENT_CANCEL)
                raise
            finally:
                if ex.completion_tokens is not None and not ex.streamed:
                    self.admission.on_tokens(ticket, ex.completion_tokens)
                self.admission.release(ticket, outcome)
        ex.ending = "upstream_error"
        message = str(last_error) if last_error else "No other backend to retry on."
        raise GatewayError(
            503,
            f"Upstream unavailable: {message}.",
            "upstream_unavailable",
            headers=[(b"retry-after", b"1"), (b"x-kvgate-reason", b"upstream_unavailable")],
        )

    async def _admit(self, call: Call, after_failure: bool) -> Ticket:
        """The flow controller's answer: a ticket now, after waiting, or a refusal raised."""
        ex = call.ex
        decision = self.admission.submit(call.request)
        if isinstance(decision, Waiter):
            decision = await self._wait(call, decision)
        if isinstance(decision, Reject):
            self.metrics.admissions["rejected", ex.priority or "-", decision.reason] += 1
            if decision.status != 400:  # a 400 tells no Retry-After: nothing to retry
                self.metrics.observe_retry_after(decision.retry_after_s)
            ex.reason = decision.reason
            raise _rejection(decision, after_failure=after_failure)
        self.metrics.admissions["admitted", ex.priority or "-", "admitted"] += 1
        return decision.ticket

    async def _wait(self, call: Call, waiter: Waiter) -> Decision:
        """Wait for the core's decision, until the waiter's deadline.

        The core calls `notify` from inside whichever call freed the room. A client that
        leaves (the scope is cancelled) leaves the queue; if the grant raced its departure,
        the granted ticket is given back at once, so nothing stays held for nobody.
        """
        loop = self._loop or self._bind_loop()
        future: asyncio.Future[Decision] = loop.create_future()

        def notify(decision: Decision) -> None:
            if not future.done():
                future.set_result(decision)

        waiter.notify = notify
        ex = call.ex
        ex.stage = "queued"
        started = time.monotonic()
        remaining = waiter.deadline - self.admission.clock.now()
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                return await future
        except TimeoutError:
            return self.admission.expire(waiter)
        except BaseException:
            self.admission.cancel(waiter)
            granted = waiter.decision
            if isinstance(granted, Admit):
                self.admission.release(granted.ticket, Outcome.CLIENT_CANCEL)
            raise
        finally:
            ex.queued_s = time.monotonic() - started
            self.metrics.observe_queue_wait(ex.priority or "-", ex.queued_s)

    async def _exchange(self, call: Call, backend: Backend, ticket: Ticket) -> Outcome:
        """One attempt on one backend; closes the upstream response on every early exit."""
        scope, ex, parsed, body = call.scope, call.ex, call.parsed, call.body
        cscope = call.cscope
        assert cscope is not None
        path_qs = scope["path"] + (
            "?" + scope["query_string"].decode() if scope["query_string"] else ""
        )
        headers = request_headers(scope["headers"], ex.request_id, _DROP_REQUEST)
        id_field = backend.adapter.request_id_field
        if id_field is not None and parsed is not None:
            body = _with_field(body, id_field, ex.request_id)
        response: H1Response | None = None
        clean = False
        cscope.deadline(self.upstream.first_byte_timeout_s, "first_byte_timeout")
        ex.stage = "headers"
        try:
            response = await self.pool.open(backend, scope["method"], path_qs, headers, body)
            content_type = response.content_type
            if response.status == 200 and content_type.startswith("text/event-stream"):
                outcome = await self._relay_stream(call, response, ticket)
            else:
                outcome = await self._relay_whole(call, response, ticket)
            clean = outcome is Outcome.DONE
            return outcome
        except UpstreamConnectError:
            raise
        except UpstreamError as exc:
            self.metrics.upstream_errors[backend.node_id, exc.kind] += 1
            ex.ending = "upstream_error"
            raise GatewayError(502, f"Upstream error: {exc}.", "upstream_error") from None
        finally:
            cscope.clear_deadline()
            if clean and response is not None:
                response.release()
            else:
                close_quietly(response)
                self._propagated(ex, cscope, backend)

    def _propagated(self, ex: Exchange, cscope: CancelScope, backend: Backend) -> None:
        """The upstream request is closed: time it, and use the engine's abort API too."""
        if cscope.reason is None:
            return
        since = ex.disconnected_at if cscope.reason == "client_cancel" else cscope.cancelled_at
        if since is not None:
            self.metrics.observe_cancel(ex.stage, time.monotonic() - since)
        if getattr(backend.adapter, "abort_supported", False):
            self.spawn(self._abort(backend, ex.request_id, ex.route))

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

    async def _after_cancel(self, send: Send, ex: Exchange, reason: str) -> None:
        """Answer (if anyone is listening) after the scope was cancelled for `reason`."""
        if reason == "client_cancel":
            ex.ending = "client_cancel"
            if ex.first_byte_at is None:
                ex.status = 499
            if ex.streamed and ex.completion_tokens is None:
                ex.completion_tokens = max(0, ex.events) or None
            if ex.streamed and not ex.saw_done:  # leaving after `[DONE]` loses nothing
                self.metrics.observe_client_gone_stream(
                    ex.events - ex.events_after_disconnect, ex.events_after_disconnect
                )
            return
        ex.ending = "shutdown" if reason == "shutdown" else "upstream_error"
        if reason != "shutdown":
            self.metrics.upstream_errors[ex.backend, reason] += 1
        messages = {
            "first_byte_timeout": (504, "The upstream did not answer in time.", "upstream_timeout"),
            "read_timeout": (504, "The upstream stopped sending.", "upstream_timeout"),
            "shutdown": (503, "The gateway is shutting down.", "shutting_down"),
        }
        status, message, code = messages.get(reason, (502, "Upstream error.", "upstream_error"))
        with contextlib.suppress(Exception):
            if ex.first_byte_at is None:
                ex.status = status
                await send_error(
                    send,
                    GatewayError(status, message, code, headers=[(b"retry-after", b"1")]),
                    ex.request_id.encode(),
                )
            elif not ex.response_done:
                await _end_stream_with_error(send, ex, status, message, code)

    # ---- relaying ------------------------------------------------------------------------------

    async def _relay_whole(self, call: Call, response: H1Response, ticket: Ticket) -> Outcome:
        send, ex, parsed = call.send, call.ex, call.parsed
        head = call.scope["method"] == "HEAD"
        ex.stage = "waiting"
        try:
            data = await response.read()
        except (UpstreamError, OSError) as exc:
            self.metrics.upstream_errors[ex.backend, "reset"] += 1
            ex.ending = "upstream_error"
            raise GatewayError(
                502, "The upstream closed the connection mid-response.", "upstream_error"
            ) from exc
        now = time.monotonic()
        ex.first_token_at = now
        self.admission.on_first_token(ticket)
        if response.status >= 500:
            self.metrics.upstream_errors[ex.backend, "status"] += 1
        headers = _response_headers(response.raw_headers, ex.request_id)
        if head:  # the length a GET would have had, as the upstream said
            headers += [(k, v) for k, v in response.raw_headers if k.lower() == b"content-length"]
        else:
            headers.append((b"content-length", str(len(data)).encode()))
        ex.status = response.status
        ex.response_done = True
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        ex.first_byte_at = time.monotonic()
        await send({"type": "http.response.body", "body": data, "more_body": False})
        if response.status == 200 and b'"usage"' in data:
            self._learn_usage(ex, parsed, _usage_from_json(data))
        return Outcome.DONE

    async def _relay_stream(self, call: Call, response: H1Response, ticket: Ticket) -> Outcome:
        send, ex, cscope = call.send, call.ex, call.cscope
        assert cscope is not None
        ex.streamed = True
        ex.status = 200
        headers = _response_headers(response.raw_headers, ex.request_id)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        ex.first_byte_at = time.monotonic()
        ex.stage = "first_token"
        tally = _StreamTally(self, call, ticket)
        writer = splice.writer_for(call.scope)
        try:
            if writer is not None:
                await _splice(writer, response, tally)
            else:
                while chunk := await response.readany():
                    tally.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (UpstreamError, OSError):
            self.metrics.upstream_errors[ex.backend, "reset"] += 1
            await _end_stream_with_error(
                send, ex, 502, "The upstream connection failed mid-stream.", "upstream_error"
            )
            return Outcome.UPSTREAM_ERROR
        if ex.completion_tokens is None:
            ex.completion_tokens = max(0, ex.events) or None
        ex.response_done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return Outcome.DONE

    def _learn_usage(
        self, ex: Exchange, parsed: ParsedRequest | None, usage: dict[str, Any] | None
    ) -> None:
        if not usage:
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            ex.prompt_tokens = prompt
            if parsed is not None and prompt > 0 and ex.estimated_prompt > 0:
                try:
                    self.estimator.learn(parsed.model, ex.estimated_prompt, prompt)
                except Exception:
                    log.debug("cost estimator could not learn", exc_info=True)
        if isinstance(completion, int) and not isinstance(completion, bool):
            ex.completion_tokens = completion

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _finish(self, ex: Exchange) -> None:
        total = time.monotonic() - ex.started
        first = ex.first_token_at
        m = self.metrics
        m.requests[ex.route, str(ex.status), ex.backend] += 1
        m.observe_duration(ex.route, total)
        if ex.first_byte_at is not None:
            m.observe_ttfb(ex.route, ex.first_byte_at - ex.started)
        log_access(
            {
                "id": ex.request_id,
                "route": ex.route,
                "model": ex.model,
                "backend": ex.backend,
                "status": ex.status,
                "streamed": ex.streamed,
                "priority": ex.priority,
                "prompt_tokens": ex.prompt_tokens,
                "completion_tokens": ex.completion_tokens,
                "ttft_s": None if first is None else _us(first - ex.started),
                "total_s": _us(total),
                "ending": ex.ending,
                "reason": ex.reason,
                "queue_s": None if ex.queued_s is None else _us(ex.queued_s),
                "retried": ex.retried,
            }
        )


class _StreamTally:
    """Counts a stream's SSE events as its bytes pass, without decoding them.

    Fed every read from the engine, by the relay loop or from the upstream socket's callback
    (`_splice`): it stamps the first token (which starts the idle deadline), keeps the
    policy's token count current and learns from the final `usage`.
    """

    __slots__ = ("_cscope", "_done_marks", "_ex", "_found", "_parsed", "_relay", "_tail", "_ticket")

    def __init__(self, relay: Relay, call: Call, ticket: Ticket) -> None:
        assert call.cscope is not None
        self._relay = relay
        self._ex = call.ex
        self._cscope = call.cscope
        self._ticket = ticket
        self._parsed = call.parsed
        self._found = 0  # `data:` fields, `[DONE]` included
        self._done_marks = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        ex = self._ex
        ex.last_chunk_at = time.monotonic()
        if ex.first_token_at is None:
            self._first_token()
        # A `data:` split across two reads is caught by looking at the 8 bytes around the
        # boundary.
        found = chunk.count(_DATA)
        if self._tail:
            found += (self._tail + chunk[:4]).count(_DATA)
        self._tail = chunk[-4:]
        if not found:
            return
        self._found += found
        if _DONE in chunk:
            self._done_marks += chunk.count(_DONE)
            ex.saw_done = True
        ex.events = self._found - self._done_marks
        if ex.disconnected_at is not None:
            ex.events_after_disconnect += found
        relay = self._relay
        relay.admission.on_tokens(self._ticket, ex.events)
        if _PROMPT_TOKENS in chunk:
            relay._learn_usage(ex, self._parsed, _usage_from_sse(chunk))

    def _first_token(self) -> None:
        ex = self._ex
        ex.first_token_at = ex.last_chunk_at
        ex.stage = "streaming"
        relay = self._relay
        relay.admission.on_first_token(self._ticket)
        self._cscope.idle_deadline(relay.upstream.read_timeout_s, lambda: ex.last_chunk_at)


async def _splice(writer: splice.ClientWriter, response: H1Response, tally: _StreamTally) -> None:
    """Relay the rest of a stream from the upstream's callback (see kvgate.gateway.http.splice);
    returns when it is complete, raises what cut it."""

    def relay(chunk: bytes) -> None:
        tally.feed(chunk)
        if not writer.write(chunk):  # the client is slow: stop reading the engine
            response.pause()
            writer.when_writable(response.resume)

    try:
        error = await response.splice(relay)
    finally:
        writer.when_writable(None)
    if error is not None:
        raise error


def _us(seconds: float) -> float:
    """Seconds to the microsecond, for the log: a truncation (~0.12 µs) where `round(x, 6)`
    goes through a decimal conversion (~0.32 µs, timeit, best of 5)."""
    return int(seconds * 1_000_000) / 1_000_000


_OUTCOMES = {
    "client_cancel": Outcome.CLIENT_CANCEL,
    "shutdown": Outcome.SHUTDOWN,
    "first_byte_timeout": Outcome.UPSTREAM_ERROR,
    "read_timeout": Outcome.UPSTREAM_ERROR,
}


async def _end_stream_with_error(
    send: Send, ex: Exchange, status: int, message: str, code: str
) -> None:
    """Close a stream that already answered 200 with an SSE `error` event and a clean end."""
    ex.ending = "upstream_error" if code != "shutting_down" else "shutdown"
    ex.response_done = True
    with contextlib.suppress(Exception):
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(status, message, code),
                "more_body": True,
            }
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass(frozen=True, slots=True)
class _Fields:
    """What kvgate reads from a request's headers, in one pass."""

    request_id: str
    priority: str | None
    max_wait_ms: str | None
    declared: int | None

    def admission_request(self, scope: Scope) -> AdmissionRequest:
        """The admission request's header-borne fields (400 on a bad priority or bound);
        the tenant is the one the front door authenticated (`kvgate.gateway.security`)."""
        try:
            priority = Priority.parse(self.priority)
        except ValueError as exc:
            raise GatewayError(
                400, str(exc), "invalid_priority", param="X-Kvgate-Priority"
            ) from None
        max_wait_s: float | None = None
        if self.max_wait_ms is not None:
            text = self.max_wait_ms.strip()
            if not text.isdigit() or len(text) > 9:
                raise GatewayError(
                    400,
                    "X-Kvgate-Max-Wait-Ms must be a whole number of milliseconds.",
                    "invalid_max_wait",
                    param="X-Kvgate-Max-Wait-Ms",
                )
            max_wait_s = int(text) / 1000.0
        return AdmissionRequest(
            self.request_id,
            RequestCost(0, 0),
            priority,
            tenant=scope.get(TENANT_SCOPE_KEY) or "",
            max_wait_s=max_wait_s,
        )


def _request_fields(headers: Sequence[tuple[bytes, bytes]]) -> _Fields:
    """Request id, priority, wait bound and declared length, in one pass over the headers."""
    rid: str | None = None
    priority: str | None = None
    max_wait: str | None = None
    declared: int | None = None
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isascii() and text.isprintable():
                rid = text
        elif name == b"x-kvgate-priority":
            priority = value.decode("latin-1")
        elif name == b"x-kvgate-max-wait-ms":
            max_wait = value.decode("latin-1")
        elif name == b"content-length" and value.isdigit():
            declared = int(value)
    # 128 random bits without the syscall `uuid4()` makes: ids need to be unique, not secret.
    return _Fields(rid or f"{random.getrandbits(128):032x}", priority, max_wait, declared)


def _with_field(body: bytes, name: str, value: str) -> bytes:
    """The JSON body with `name` set to `value`, e.g. SGLang's `rid`, which its abort API
    needs: the gateway's id replaces any the client sent, or the abort would miss."""
    data = orjson.loads(body)
    data[name] = value
    return orjson.dumps(data)


async def _read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    if declared is not None and declared > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        more = message.get("more_body", False)
        if not more and not parts:
            return chunk
        parts.append(chunk)
        if not more:
            return b"".join(parts)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"The request body is larger than {limit} bytes.", "request_too_large")


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code, param=param)


#: The largest `max_tokens` accepted: the int32 range that engines written in C++ and Rust
#: parse it into, so no engine is sent a number it cannot read. No model's context comes
#: near it; whether a request fits a node's KV cache is the admission's question.
MAX_TOKENS_CEILING = 2**31 - 1


def parse_completion(body: bytes, max_tokens_limit: int = MAX_TOKENS_CEILING) -> ParsedRequest:
    """Validate only what the gateway needs (model, stream, max_tokens); relay the rest."""
    if not body:
        raise _bad("The request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _bad(
            f"The request body is not valid JSON (UTF-8): {exc}.", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise _bad("The request body must be a JSON object.", code="invalid_json")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("`model` is required and must be a non-empty string.", "model")
    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("`stream` must be a boolean.", "stream")
    max_tokens: int | None = None
    for key in ("max_tokens", "max_completion_tokens"):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(f"`{key}` must be an integer.", key)
        if value < 0:
            raise _bad(f"`{key}` must not be negative.", key)
        if value > max_tokens_limit:
            raise _bad(f"`{key}` must be at most {max_tokens_limit}.", key)
        max_tokens = value if max_tokens is None else min(max_tokens, value)
    return ParsedRequest(model=model, stream=stream, max_tokens=max_tokens, data=data)


def _model_of(body: bytes) -> str | None:
    """The `model` of a pass-through JSON body, if it has one (no error if it is not JSON)."""
    if not body or b'"model"' not in body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def _rejection(decision: Reject, *, after_failure: bool) -> GatewayError:
    """The policy's refusal as an OpenAI error with Retry-After (whole seconds, at least 1)."""
    retry_s = max(0.0, decision.retry_after_s)
    headers = [
        (b"retry-after", str(max(1, math.ceil(retry_s))).encode()),
        (b"retry-after-ms", str(max(1, round(retry_s * 1000))).encode()),
        (b"x-kvgate-reason", decision.reason.encode("latin-1", "replace")),
    ]
    status = 503 if after_failure and decision.status != 400 else decision.status
    code = _CODES.get((status, decision.reason)) or _CODES[status, ""]
    if status == 400:  # it can never be served as sent: nothing to retry
        return GatewayError(400, decision.message, code, param="max_tokens", headers=headers[2:])
    return GatewayError(status, decision.message, code, headers=headers)


_CODES = {
    (429, ""): "cluster_saturated",
    (429, "tenant_limit"): "tenant_limit_exceeded",
    (429, "queue_full"): "queue_full",
    (503, ""): "service_unavailable",
    (400, ""): "context_length_exceeded",
    (400, "tenant_limit"): "tenant_limit_exceeded",
}


def _reason(err: GatewayError) -> str:
    """Why the gateway refused, for the access log: the `x-kvgate-reason` it sends, else
    the error's code."""
    for name, value in err.headers:
        if name == b"x-kvgate-reason":
            return value.decode("latin-1")
    return str(err.code)


def _response_headers(
    raw: Sequence[tuple[bytes, bytes]], request_id: str
) -> list[tuple[bytes, bytes]]:
    out = []
    for name, value in raw:
        name = name.lower()
        if name not in _DROP_RESPONSE:
            out.append((name, value))
    out.append((b"x-request-id", request_id.encode()))
    return out


def _usage_from_json(data: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    usage = parsed.get("usage") if isinstance(parsed, dict) else None
    return usage if isinstance(usage, dict) else None


def _usage_from_sse(chunk: bytes) -> dict[str, Any] | None:
    """The usage object of the (final) event in `chunk` that carries one."""
    for line in reversed(chunk.split(b"\n")):
        if line.startswith(_DATA) and _PROMPT_TOKENS in line:
            usage = _usage_from_json(line[5:])
            if usage:
                return usage
    return None
