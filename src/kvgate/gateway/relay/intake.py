"""Reading a request: from the client's headers and body to the two immutable requests.

`read_head` takes what kvgate reads from the headers in one pass (request id, priority,
wait bound, declared length, the client's timeout), before anything else, so that even a
refusal carries the request's id. `Intake` then reads the body (`kvgate.gateway.http.body`: 413 past
`limits.max_body_bytes`), validates what the gateway needs of it (400 on anything
malformed, never a crash), resolves the model's backends (404 when none serves it, 503
when none is reachable) and costs it, and builds, once each:

- the `ClientRequest` (`kvgate.gateway.relay.call`): what the client asked, with the body
  as it goes upstream;
- the core's `AdmissionRequest`: its cost, priority, tenant, model, candidate nodes and,
  when known, the prompt's token ids.

A completion's JSON is parsed once (orjson) and only `model`, `stream`, `max_tokens` (or
`max_completion_tokens`) and the prompt are checked; the rest is relayed as sent. Its
prompt is counted as the engine will count it where possible (kvgate.gateway.tokens: the
model's tokenizer, else the engine's `/tokenize`, else the estimate; the access record
keeps the basis, and a count that comes late re-costs the request while it waits,
kvgate.gateway.relay.recost). It is costed within the model's context length when the
engines list it, and what an engine would refuse for that length is refused here, before
admission (`context.py`). A request that sends no `max_tokens` is relayed as sent when the
engine's default is known: a vLLM completion generates 16 tokens (OpenAI's default), a
chat up to the rest of the context, which is then its planned cap (how long it runs is
planned by the lengths learned per model). Where neither is known, admission plans for
`admission.default_max_tokens` of output and the body sent upstream says so. Any other
`/v1/...` request passes through unread except for its `model`, costed at a token per 4
bytes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from kvgate.core.cost import CostBasis, CostEstimator
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.gateway.http.asgi import Receive, Scope
from kvgate.gateway.http.body import read_body
from kvgate.gateway.http.errors import GatewayError
from kvgate.gateway.relay.call import AccessRecord, ClientRequest
from kvgate.gateway.relay.context import check_context
from kvgate.gateway.relay.recost import Recosting
from kvgate.gateway.relay.upstream import Upstream
from kvgate.gateway.tokens.counting import PromptCounter

#: The largest `max_tokens` accepted: the int32 range that engines written in C++ and Rust
#: parse it into, so no engine is sent a number it cannot read. No model's context comes
#: near it; whether a request fits a node's KV cache is the admission's question.
MAX_TOKENS_CEILING = 2**31 - 1
#: What vLLM's `/v1/completions` generates when `max_tokens` is absent (OpenAI's default);
#: its chat completions go on to the end of the context.
VLLM_COMPLETION_DEFAULT = 16
#: The dialects whose completions default to `VLLM_COMPLETION_DEFAULT`.
_SIXTEEN_BY_DEFAULT = frozenset({"vllm"})
#: The OpenAI SDKs' timeout for the try, in seconds: the Node SDK's whole timeout, the
#: Python SDK's read timeout (kvgate.core.flow.patience says what either bounds).
_TIMEOUT_HEADERS = frozenset({b"x-stainless-timeout", b"x-stainless-read-timeout"})
#: The milliseconds a proxy in front gives the whole answer (Envoy's route timeout, which
#: spans the response to its last byte, streamed or not).
_ANSWER_TIMEOUT_MS = b"x-envoy-expected-rq-timeout-ms"


class Head(NamedTuple):
    """The header values kvgate reads, as sent (validated when the request is built)."""

    request_id: str
    declared_length: int | None
    priority: str | None
    max_wait_ms: str | None
    timeout_s: float | None = None
    answer_timeout_s: float | None = None


class CompletionFields(NamedTuple):
    """What the gateway validates of a completion's JSON body, and the body itself."""

    model: str
    stream: bool
    max_tokens: int | None
    data: dict[str, Any]


def read_head(headers: Sequence[tuple[bytes, bytes]]) -> Head:
    """Request id, declared length, priority, wait bound, the client's timeout (the
    OpenAI SDKs': `_TIMEOUT_HEADERS`) and a proxy's for the whole answer, in one pass over
    the headers."""
    rid: str | None = None
    priority: str | None = None
    max_wait: str | None = None
    declared: int | None = None
    timeout: float | None = None
    whole: float | None = None
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
        elif name in _TIMEOUT_HEADERS:
            timeout = _least(timeout, _seconds(value))
        elif name == _ANSWER_TIMEOUT_MS:
            ms = _seconds(value)
            whole = _least(whole, None if ms is None else ms / 1000.0)
    # 128 random bits without the syscall `uuid4()` makes: ids need to be unique, not secret.
    rid = rid or f"{random.getrandbits(128):032x}"
    return Head(rid, declared, priority, max_wait, timeout, whole)


def _seconds(value: bytes) -> float | None:
    """A timeout header's number; None when it is not a positive finite number (an SDK's
    or a proxy's header, not kvgate's: ignored rather than refused)."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0.0 < seconds < math.inf else None


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class Intake:
    """Reads, validates and costs requests for the relay; shared by all of them."""

    def __init__(
        self,
        upstream: Upstream,
        estimator: CostEstimator,
        max_body_bytes: int,
        counter: PromptCounter,
        recosting: Recosting,
    ) -> None:
        self.pool = upstream.pool
        self.catalog = upstream.catalog
        self.estimator = estimator
        self.max_body_bytes = max_body_bytes
        self.counter = counter
        self.recosting = recosting

    async def completion(
        self, head: Head, scope: Scope, receive: Receive, record: AccessRecord
    ) -> tuple[ClientRequest, AdmissionRequest]:
        """POST /v1/completions and /v1/chat/completions: parsed, checked and costed."""
        body = await read_body(receive, self.max_body_bytes, head.declared_length)
        priority, max_wait_s = _header_fields(head, record)
        model, stream, max_tokens, data = parse_completion(body)
        record.model = model
        if "messages" not in data and "prompt" not in data:
            field = "messages" if record.route.endswith("/chat/completions") else "prompt"
            raise _bad(f"`{field}` is required.", field)
        candidates = await self._nodes_for(model)
        limit = self.catalog.max_model_len(model)
        estimator = self.estimator
        implicit = self._implicit_output(record.route, candidates)
        try:
            basis = estimator.basis(model, data, limit, implicit)
        except ValueError as exc:
            raise _bad(f"{exc}.", getattr(exc, "param", None)) from None
        if not basis.exact:
            basis = await self._count(record, basis, data, candidates)
        record.basis = basis
        cost = estimator.price(basis)
        check_context(limit, data, cost, estimator, basis)
        if max_tokens is None and limit is None and implicit is None:
            body = self._with_default_max_tokens(data)
        tenant = record.tenant
        client = ClientRequest(
            head.request_id, priority, tenant, max_wait_s, body, model, stream, max_tokens, data
        )
        request = AdmissionRequest(
            head.request_id,
            cost,
            priority,
            tenant=tenant,
            model=model,
            candidates=candidates,
            exact_output=client.exact_output,
            max_wait_s=max_wait_s,
            timeout_s=head.timeout_s,
            answer_timeout_s=head.answer_timeout_s,
            stream=stream,
            prompt_ids=basis.ids,
        )
        return client, request

    async def _count(
        self, record: AccessRecord, basis: CostBasis, data: dict[str, Any], nodes: tuple[str, ...]
    ) -> CostBasis:
        """The basis with the prompt counted as the engine counts it, when a count comes in
        time; a count still on its way is left on the record, to re-cost the request."""
        chat = "messages" in data
        counter = self.counter
        count = counter.local(basis.model, data, chat)
        if count is None:
            count, record.late_count = await counter.remote(basis.model, data, nodes)
        if count is None:
            return basis
        record.basis = basis
        counted = self.recosting.counted(record, count)
        return basis if counted is None else counted

    def _implicit_output(self, route: str, candidates: tuple[str, ...]) -> int | None:
        """What the engines generate for a completion that names no cap, when that is a
        fixed amount: 16 on vLLM's `/v1/completions` (every candidate speaks vLLM)."""
        if route != "/v1/completions" or not candidates:
            return None
        backends = self.pool.backends
        for node in candidates:
            backend = backends.get(node)
            if backend is None or backend.engine not in _SIXTEEN_BY_DEFAULT:
                return None
        return VLLM_COMPLETION_DEFAULT

    async def passthrough(
        self, head: Head, scope: Scope, receive: Receive, record: AccessRecord
    ) -> tuple[ClientRequest, AdmissionRequest]:
        """Any other /v1/... request: relayed unread, to a backend serving its `model`."""
        body = await read_body(receive, self.max_body_bytes, head.declared_length)
        priority, max_wait_s = _header_fields(head, record)
        model = _model_of(body)
        if model is None:
            candidates = tuple(self.pool.backends)
        else:
            record.model = model
            candidates = await self._nodes_for(model)
        tenant = record.tenant
        client = ClientRequest(head.request_id, priority, tenant, max_wait_s, body, model)
        # Embeddings and the like hold KV only for their input, roughly a token per 4 bytes.
        cost = RequestCost(prompt_tokens=len(body) // 4, max_output_tokens=0)
        request = AdmissionRequest(
            head.request_id,
            cost,
            priority,
            tenant=tenant,
            model=model or "",
            candidates=candidates,
            max_wait_s=max_wait_s,
            timeout_s=head.timeout_s,
            answer_timeout_s=head.answer_timeout_s,
        )
        return client, request

    def _with_default_max_tokens(self, data: dict[str, Any]) -> bytes:
        """The body with the output cap admission assumed, made explicit, for a model whose
        context length is unknown: without it the engine may generate up to a context
        kvgate does not know, past what was planned. Re-encoding happens only then."""
        cap = self.estimator.settings.default_max_tokens
        return orjson.dumps({**data, "max_tokens": cap})

    async def _nodes_for(self, model: str) -> tuple[str, ...]:
        nodes = await self.catalog.resolve(model)
        if nodes is not None:
            return nodes
        if not self.catalog.known:
            raise GatewayError(
                503,
                "No backend is reachable to serve this request.",
                "no_backend",
                headers=[(b"retry-after", b"1")],
            )
        raise GatewayError(
            404, f"The model `{model}` does not exist.", "model_not_found", param="model"
        )


def _header_fields(head: Head, record: AccessRecord) -> tuple[Priority, float | None]:
    """The priority (noted on the record) and the client's wait bound (400 on a bad one
    of either)."""
    try:
        priority = Priority.parse(head.priority)
    except ValueError as exc:
        raise GatewayError(400, str(exc), "invalid_priority", param="X-Kvgate-Priority") from None
    record.priority = priority.label
    if head.max_wait_ms is None:
        return priority, None
    text = head.max_wait_ms.strip()
    if not text.isdigit() or len(text) > 9:
        raise GatewayError(
            400,
            "X-Kvgate-Max-Wait-Ms must be a whole number of milliseconds.",
            "invalid_max_wait",
            param="X-Kvgate-Max-Wait-Ms",
        )
    return priority, int(text) / 1000.0


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code, param=param)


def parse_completion(body: bytes, max_tokens_limit: int = MAX_TOKENS_CEILING) -> CompletionFields:
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
    return CompletionFields(model, stream, max_tokens, data)


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
