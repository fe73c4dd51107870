"""Live mode: one simulated engine behind vLLM's OpenAI-compatible HTTP API (aiohttp).

An engine task steps the pure model in real time: `begin_step(now)`, sleep until the step's
end, `finish_step()`, then hand each produced token to the handler waiting for it. A client
that disconnects (streaming or not) is reported with `Engine.disconnect`, which aborts the
request at the next step unless the engine runs with `abort_on_disconnect=False`.

What a client sees follows vLLM: `cmpl-<X-Request-Id>` / `chatcmpl-<X-Request-Id>` ids
(engine ids `cmpl-<id>-0` and `chatcmpl-<id>`, the ones `POST /inference/v1/abort_requests`
takes; a reused X-Request-Id gets a `-dupN` engine id until its namesake's end was reported,
and an abort reaches both, as vLLM's random id suffixes make it), `usage` and
`stream_options.include_usage`, `ignore_eos` and `priority` extensions, `POST /tokenize`
(vLLM's answer: the ids of the tokens the engine counts for a prompt or a chat, so that a
gateway counts exactly what the simulator will), OpenAI-style JSON errors. What the
engine reads of a request (prompt length, options) is parsed in
`kvgate.sim.openai_request`. The generated text is filler; one token is one short word.

With prefix caching the engine is given each prompt's token ids (the ones `/tokenize`
answers); with a `KVPublisher` each step's KV events are published as vLLM publishes them
(`kvgate.sim.kv_publisher`), and `POST /reset_prefix_cache` clears the cache as vLLM's
does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from kvgate.sim.metrics import CONTENT_TYPE, MetricsPage, only_samples
from kvgate.sim.model.engine import Engine, EngineError, StepResult
from kvgate.sim.openai_request import (
    BadRequest,
    ParsedRequest,
    chat_request,
    check_model,
    completion_request,
    prompt_ids,
    read_json,
)

if TYPE_CHECKING:  # pyzmq and msgspec: only with --kv-events-config (the kv-events extra)
    from kvgate.sim.kv_publisher import KVPublisher

_WORDS = tuple(
    " " + w
    for w in (
        "the kv cache was full so the gateway shed load and every stream kept its pace "
        "while the engine stayed below its watermark"
    ).split()
)
_log = logging.getLogger(__name__)
_MAX_BODY = 64 * 1024 * 1024


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
        status, "InternalServerError"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class StepTimeline:
    """When each step of the live engine is due to end: back to back on the model's clock.

    Waking handlers and writing their chunks after a step is the API server's work, which
    runs beside a real engine's loop (vLLM's API server is its own process), not inside it.
    So the time the loop spends between two steps is paid back from the next step's sleep:
    each step is due `duration` after the previous one was due, and steps end late only
    when the process cannot keep up. After an idle spell (`reset`), or once more than
    `max_behind_s` behind, the timeline restarts from the step's own start.
    """

    def __init__(self, max_behind_s: float = 0.05) -> None:
        self.max_behind_s = max_behind_s
        self._due: float | None = None

    def reset(self) -> None:
        self._due = None

    def schedule(self, start: float, duration: float) -> float:
        """The engine time at which the step that began at `start` is due to end."""
        if self._due is None or start - self._due > self.max_behind_s:
            self._due = start
        self._due += duration
        return self._due


class _Stream:
    """Where the engine loop leaves a request's progress for its handler.

    `orphaned`: the handler is gone but the engine has not yet reported the request's end
    (its abort is applied when a step begins and reported when that step ends; a zombie
    runs to its finish). The stream keeps its engine id taken until that report.
    """

    __slots__ = ("aborted", "event", "finish_reason", "orphaned", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.finish_reason: str | None = None
        self.aborted = False
        self.orphaned = False
        self.event = asyncio.Event()

    @property
    def ended(self) -> bool:
        """The engine reported this request's end (finished or aborted)."""
        return self.finish_reason is not None or self.aborted


class SimServer:
    """One engine and its HTTP app. `start()` binds; `close()` stops everything."""

    def __init__(
        self,
        engine: Engine,
        model_name: str = "sim-llama",
        chars_per_token: float = 4.0,
        time_scale: float = 1.0,
        engine_label: str = "0",
        preset: str = "custom",
        kv_publisher: KVPublisher | None = None,
    ) -> None:
        if chars_per_token <= 0 or time_scale <= 0:
            raise ValueError("chars_per_token and time_scale must be positive")
        self.engine = engine
        engine.record_emissions = True
        self.model_name = model_name
        self.chars_per_token = chars_per_token
        self.time_scale = time_scale
        self.metrics = MetricsPage(engine, model_name, engine_label, preset)
        # Engine id -> its stream, from `add_request` until the engine *reported* the end.
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._t0 = time.monotonic()
        self._id_counter = 0
        self.lag_seconds_total = 0.0  # how late steps ended versus the model (CPU overload)
        self.failure: BaseException | None = None
        self.metrics.lag_source = lambda: self.lag_seconds_total
        self.port: int | None = None
        self.kv_publisher = kv_publisher
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics_named)
        app.router.add_post("/inference/v1/abort_requests", self._abort_requests)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Bind and start the engine loop; returns the bound port."""
        self._t0 = time.monotonic()
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        self._loop_task = asyncio.create_task(self._engine_loop(), name="sim-engine")
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._runner is not None:
            await self._runner.cleanup()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()

    @property
    def open_requests(self) -> int:
        """Requests whose end the engine has not reported yet, with or without a handler."""
        return len(self._streams)

    def now(self) -> float:
        """Engine time: seconds since start, divided by the time scale."""
        return (time.monotonic() - self._t0) / self.time_scale

    # ------------------------------------------------------------------ engine loop
    async def _engine_loop(self) -> None:
        try:
            await self._run_engine()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the model: fail loudly, like a dead vLLM engine
            self.failure = exc
            _log.exception("simulated engine failed; /health now answers 500")
            for stream in self._streams.values():
                stream.aborted = True
                stream.event.set()
            self._streams = {k: s for k, s in self._streams.items() if not s.orphaned}

    async def _run_engine(self) -> None:
        engine = self.engine
        timeline = StepTimeline()
        while True:
            if not engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                timeline.reset()
            start = self.now()
            duration = engine.begin_step(start)
            if duration is None:
                continue
            due = timeline.schedule(start, duration)
            delay = (due - self.now()) * self.time_scale
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let handlers run even when we lag
            self.lag_seconds_total += max(0.0, self.now() - due)
            result = engine.finish_step()
            if result.kv_events and self.kv_publisher is not None:
                self.kv_publisher.publish(time.time(), result.kv_events)
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        streams = self._streams
        for rid in result.emitted:
            stream = streams.get(rid)
            if stream is not None:
                stream.tokens += 1
                stream.event.set()
        for done in result.finished:
            self._end(done.request_id, done.reason)
        for rid in result.aborted:
            self._end(rid, None)

    def _end(self, engine_id: str, finish_reason: str | None) -> None:
        """The engine reported a request's end: wake its handler, or free an orphan's id."""
        stream = self._streams.get(engine_id)
        if stream is None:
            return
        if finish_reason is None:
            stream.aborted = True
        else:
            stream.finish_reason = finish_reason
        stream.event.set()
        if stream.orphaned:
            del self._streams[engine_id]

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, exc.message, exc.param)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error_response(exc.status, exc.reason)
            raise

    # ------------------------------------------------------------------ simple routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=500 if self.failure else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE}
        )

    async def _metrics_named(self, request: web.Request) -> web.Response:
        """`/metrics/?name[]=...`: only the named samples, as vLLM's prometheus_client app
        answers there (`/metrics` itself ignores the query, as vLLM's does)."""
        page = self.metrics.render()
        names = request.query.getall("name[]", [])
        if names:
            page = only_samples(page, frozenset(names))
        return web.Response(body=page.encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.engine.config.max_model_len,
        }
        return _json({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: `{"model", "prompt"}` or `{"model", "messages"}` to
        `{"count", "max_model_len", "tokens"}`, counted as a request's prompt is."""
        body = await read_json(request)
        check_model(body, self.model_name)
        tokens = prompt_ids(body, self.chars_per_token)
        limit = self.engine.config.max_model_len
        return _json({"count": len(tokens), "max_model_len": limit, "tokens": tokens})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's `POST /reset_prefix_cache`: clears the cache unless a request holds blocks
        (200 either way, as vLLM answers; the body says which)."""
        reset = self.engine.reset_prefix_cache()
        events = self.engine.take_kv_events()
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(time.time(), events)
        return _json({"reset": reset})

    async def _abort_requests(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        ids = body.get("request_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise BadRequest("request_ids must be a list of strings", "request_ids")
        aborted = [eid for rid in ids for eid in self._namesakes(rid) if self.engine.abort(eid)]
        if aborted:
            self._wake.set()
        return _json({"aborted": aborted})

    def _namesakes(self, engine_id: str) -> list[str]:
        """`engine_id` and its live `-dupN` variants (see `_unused`), as vLLM's abort by the
        id a client gave reaches every request given that id (its own ids add a suffix)."""
        prefix = engine_id + "-dup"
        return [engine_id, *(k for k in self._streams if k.startswith(prefix))]

    # ------------------------------------------------------------------ generation
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        check_model(body, self.model_name)
        parsed = completion_request(body, self.chars_per_token, self.engine.config.max_model_len)
        xid = self._request_id(request)
        return await self._generate(
            request, parsed, f"cmpl-{xid}", f"cmpl-{xid}-0", False, self._prompt_ids(body)
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        check_model(body, self.model_name)
        parsed = chat_request(body, self.chars_per_token)
        xid = self._request_id(request)
        return await self._generate(
            request, parsed, f"chatcmpl-{xid}", f"chatcmpl-{xid}", True, self._prompt_ids(body)
        )

    def _prompt_ids(self, body: dict[str, Any]) -> tuple[int, ...] | None:
        """The prompt's token ids for a prefix-caching engine (the ones `/tokenize` gives)."""
        if not self.engine.config.enable_prefix_caching:
            return None
        return tuple(prompt_ids(body, self.chars_per_token))

    def _request_id(self, request: web.Request) -> str:
        header = request.headers.get("X-Request-Id")
        return header if header else uuid.uuid4().hex

    async def _generate(
        self,
        request: web.Request,
        p: ParsedRequest,
        public_id: str,
        engine_id: str,
        chat: bool,
        ids: tuple[int, ...] | None = None,
    ) -> web.StreamResponse:
        if self.failure is not None:
            return error_response(500, f"the simulated engine failed: {self.failure!r}")
        engine_id = self._unused(engine_id)
        try:
            self.engine.add_request(
                engine_id,
                p.prompt_tokens,
                p.max_tokens,
                self.now(),
                ignore_eos=p.ignore_eos,
                priority=p.priority,
                prompt_ids=ids,
            )
        except EngineError as exc:
            param = "max_tokens" if "max_tokens" in str(exc) else "prompt"
            raise BadRequest(str(exc), param) from None
        stream = _Stream()
        self._streams[engine_id] = stream
        self._wake.set()
        try:
            if p.stream:
                return await self._stream_out(request, p, stream, public_id, chat)
            return await self._whole(p, stream, public_id, chat)
        finally:
            self._leave(engine_id, stream)

    def _unused(self, engine_id: str) -> str:
        """`engine_id`, or a `-dupN` variant while a namesake's end is not yet reported.

        A reused X-Request-Id is normal: kvgate resends a request with the same id on a
        fresh connection when the first was reset before any answer. The predecessor's
        abort is applied when a step begins (the engine forgets the id) but reported when
        that step ends; a successor that took the bare id in between would be handed the
        predecessor's abort, so the id stays taken until the report (`_end`).
        """
        if engine_id in self.engine or engine_id in self._streams:
            self._id_counter += 1
            return f"{engine_id}-dup{self._id_counter}"
        return engine_id

    def _leave(self, engine_id: str, stream: _Stream) -> None:
        """The handler is done: free the id if the engine reported the end, else disconnect
        (the engine aborts at its next step) and leave the stream as an orphan until then."""
        if stream.ended:
            del self._streams[engine_id]
            return
        stream.orphaned = True
        self.engine.disconnect(engine_id)
        self._wake.set()

    async def _whole(
        self, p: ParsedRequest, stream: _Stream, public_id: str, chat: bool
    ) -> web.Response:
        while stream.finish_reason is None and not stream.aborted:
            await stream.event.wait()
            stream.event.clear()
        if stream.aborted:
            return error_response(500, "the request was aborted by the engine")
        text = _text(0, stream.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": stream.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None, stop_reason=None)
        return _json(
            {
                "id": public_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage(p.prompt_tokens, stream.tokens),
            }
        )

    async def _stream_out(
        self, request: web.Request, p: ParsedRequest, stream: _Stream, public_id: str, chat: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())
        head = {
            "id": public_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
        }
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                await response.write(_sse({**head, "choices": [first]}))
            await self._stream_tokens(response, head, p, stream, chat)
        except ConnectionError:
            pass  # the client left; `_generate` reports the disconnect to the engine
        return response

    async def _stream_tokens(
        self,
        response: web.StreamResponse,
        head: dict[str, Any],
        p: ParsedRequest,
        stream: _Stream,
        chat: bool,
    ) -> None:
        sent = 0
        while True:
            await stream.event.wait()
            stream.event.clear()
            if stream.aborted:
                break
            count, reason = stream.tokens, stream.finish_reason
            if count > sent or reason is not None:
                text = _text(sent, count)
                sent = count
                choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice.update(text=text, stop_reason=None)
                await response.write(_sse({**head, "choices": [choice]}))
            if reason is not None:
                break
        if p.include_usage and stream.finish_reason is not None:
            usage = _usage(p.prompt_tokens, stream.tokens)
            await response.write(_sse({**head, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


def _text(start: int, end: int) -> str:
    n = len(_WORDS)
    return "".join(_WORDS[i % n] for i in range(start, end))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _json(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
