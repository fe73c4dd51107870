"""Relaying an engine's answer to the client: whole, or chunk by chunk as it streams.

An ordinary response is read whole and sent in two ASGI messages. A server-sent event
stream is relayed as it comes, never buffered: spliced when both ends allow it
(`kvgate.gateway.http.splice`: each read is written to the client from the upstream
socket's callback, no task switch per chunk), else by a loop that awaits `send()` before
the next read. Either way a slow client slows the upstream read and memory stays bounded.

`StreamTally` sees every read of a stream as bytes, without decoding them: it stamps the
first token (which starts the idle deadline), counts the `data:` events so the core's books
hold the tokens generated so far, and hands the final `usage` to the cost estimator, which
learns how far its prompt estimate was from the engine's count (and to the prompt counter,
which checks a tokenizer's exact count against it). A stream that fails after its 200 ends
with an SSE `error` event (`end_stream_with_error`). Every answer carries the tenant's
`x-ratelimit-*` headers (`ratelimit`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import orjson

from kvgate.core.admission import Outcome, Ticket
from kvgate.core.flow import FlowController
from kvgate.gateway.http import splice
from kvgate.gateway.http.asgi import Send
from kvgate.gateway.http.errors import GatewayError, UpstreamError, sse_error_event
from kvgate.gateway.http.h1client import H1Response
from kvgate.gateway.ops.telemetry import GatewayMetrics
from kvgate.gateway.relay.call import AccessRecord, Call, ClientRequest
from kvgate.gateway.relay.ratelimit import rate_limit_headers
from kvgate.gateway.relay.recost import Recosting
from kvgate.gateway.relay.upstream import HOP_BY_HOP
from kvgate.gateway.tokens.counting import PromptCounter

log = logging.getLogger(__name__)

#: Upstream response headers the server or this relay sets itself.
_DROP_RESPONSE = HOP_BY_HOP | {b"x-request-id", b"date", b"server"}
_DATA = b"data:"
_DONE = b"[DONE]"
_PROMPT_TOKENS = b'"prompt_tokens"'


class ResponseRelay:
    """Sends engines' answers to clients and keeps the books on them; shared by all."""

    def __init__(
        self,
        flow: FlowController,
        metrics: GatewayMetrics,
        recosting: Recosting,
        counter: PromptCounter,
        read_timeout_s: float,
    ) -> None:
        self.flow = flow
        self.metrics = metrics
        self.recosting = recosting
        self.estimator = recosting.estimator
        self.counter = counter
        self.read_timeout_s = read_timeout_s

    async def whole(self, call: Call, response: H1Response, ticket: Ticket) -> Outcome:
        """An ordinary response: read whole, then sent with its length."""
        send, record = call.send, call.record
        head = call.scope["method"] == "HEAD"
        record.stage = "waiting"
        try:
            data = await response.read()
        except (UpstreamError, OSError) as exc:
            self.metrics.upstream_errors[record.backend, "reset"] += 1
            record.ending = "upstream_error"
            raise GatewayError(
                502, "The upstream closed the connection mid-response.", "upstream_error"
            ) from exc
        record.first_token_at = time.monotonic()
        self.flow.on_first_token(ticket)
        if response.status >= 500:
            self.metrics.upstream_errors[record.backend, "status"] += 1
        headers = self.headers(response.raw_headers, call)
        if head:  # the length a GET would have had, as the upstream said
            headers += [(k, v) for k, v in response.raw_headers if k.lower() == b"content-length"]
        else:
            headers.append((b"content-length", str(len(data)).encode()))
        record.status = response.status
        record.response_done = True
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        record.first_byte_at = time.monotonic()
        await send({"type": "http.response.body", "body": data, "more_body": False})
        if response.status == 200 and b'"usage"' in data:
            self.learn_usage(record, call.client, _usage_from_json(data))
        return Outcome.DONE

    async def stream(self, call: Call, response: H1Response, ticket: Ticket) -> Outcome:
        """A server-sent event stream: relayed as it comes, spliced when possible."""
        send, record = call.send, call.record
        record.streamed = True
        record.status = 200
        headers = self.headers(response.raw_headers, call)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        record.first_byte_at = time.monotonic()
        record.stage = "first_token"
        tally = StreamTally(self, call, ticket)
        writer = splice.writer_for(call.scope)
        try:
            if writer is not None:
                await _splice(writer, response, tally)
            else:
                while chunk := await response.readany():
                    tally.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (UpstreamError, OSError):
            self.metrics.upstream_errors[record.backend, "reset"] += 1
            await end_stream_with_error(
                send, record, 502, "The upstream connection failed mid-stream.", "upstream_error"
            )
            return Outcome.UPSTREAM_ERROR
        if record.completion_tokens is None:
            record.completion_tokens = max(0, record.events) or None
        record.response_done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return Outcome.DONE

    def headers(self, raw: Sequence[tuple[bytes, bytes]], call: Call) -> list[tuple[bytes, bytes]]:
        """The engine's headers for the client, with its tenant's `x-ratelimit-*`."""
        headers = response_headers(raw, call.record.request_id)
        flow = self.flow
        return headers + rate_limit_headers(flow.budgets, call.client.tenant, flow.clock.now())

    def learn_usage(
        self, record: AccessRecord, client: ClientRequest, usage: dict[str, Any] | None
    ) -> None:
        """Take the engine's token counts; the estimator learns from a costed prompt's."""
        if not usage:
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            record.prompt_tokens = prompt
            basis = record.basis  # a completion's (None for a pass-through request)
            data = client.data
            # A prompt the engine truncated is not the prompt that was counted.
            if (
                basis is not None
                and prompt > 0
                and data is not None
                and (data.get("truncate_prompt_tokens") is None)
            ):
                try:
                    self.counter.check(basis, "messages" in data, prompt)
                    if self.estimator.learn(basis, prompt):
                        self.recosting.ratio_moved(basis.model)
                except Exception:
                    log.debug("cost estimator could not learn", exc_info=True)
        if isinstance(completion, int) and not isinstance(completion, bool):
            record.completion_tokens = completion


class StreamTally:
    """Counts a stream's SSE events as its bytes pass, without decoding them.

    Fed every read from the engine, by the relay loop or from the upstream socket's callback
    (`_splice`): it stamps the first token (which starts the idle deadline), keeps the
    policy's token count current and learns from the final `usage`.
    """

    __slots__ = ("_call", "_done_marks", "_flow", "_found", "_record", "_relay", "_tail", "_ticket")

    def __init__(self, relay: ResponseRelay, call: Call, ticket: Ticket) -> None:
        self._relay = relay
        self._flow = relay.flow
        self._call = call
        self._record = call.record
        self._ticket = ticket
        self._found = 0  # `data:` fields, `[DONE]` included
        self._done_marks = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        record = self._record
        record.last_chunk_at = time.monotonic()
        if record.first_token_at is None:
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
            record.saw_done = True
        record.events = self._found - self._done_marks
        if record.disconnected_at is not None:
            record.events_after_disconnect += found
        self._flow.on_tokens(self._ticket, record.events)
        if _PROMPT_TOKENS in chunk:
            self._relay.learn_usage(record, self._call.client, _usage_from_sse(chunk))

    def _first_token(self) -> None:
        record = self._record
        record.first_token_at = record.last_chunk_at
        record.stage = "streaming"
        self._flow.on_first_token(self._ticket)
        self._call.cscope.idle_deadline(self._relay.read_timeout_s, lambda: record.last_chunk_at)


async def _splice(writer: splice.ClientWriter, response: H1Response, tally: StreamTally) -> None:
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


async def end_stream_with_error(
    send: Send, record: AccessRecord, status: int, message: str, code: str
) -> None:
    """Close a stream that already answered 200 with an SSE `error` event and a clean end."""
    record.ending = "upstream_error" if code != "shutting_down" else "shutdown"
    record.response_done = True
    with contextlib.suppress(Exception):
        await send(
            {
                "type": "http.response.body",
                "body": sse_error_event(status, message, code),
                "more_body": True,
            }
        )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def response_headers(
    raw: Sequence[tuple[bytes, bytes]], request_id: str
) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers minus those this relay sets, plus `x-request-id`."""
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
