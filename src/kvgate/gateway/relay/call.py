"""One request as the relay carries it, in three objects.

- `ClientRequest`: what the client asked, read from its headers and body once
  (`kvgate.gateway.relay.intake`) and never changed afterwards.
- `AccessRecord`: what the access log and the metrics learn about the request while it
  runs (its stage, backend, status, token counts, timings); the one object every step
  writes to.
- `Call`: what each step after admission needs, handed from step to step: the ASGI
  channel, the client request, the record, and the cancel scope the exchange runs in.

What admission sees of the request is the core's immutable `AdmissionRequest`
(`kvgate.core.request`), built from the `ClientRequest` once it is costed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from kvgate.core.cost import CostBasis, PromptCount
from kvgate.core.request import Priority
from kvgate.gateway.http.asgi import Scope, Send
from kvgate.gateway.http.scope import CancelScope


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """What the client asked, as kvgate read it: built once, never changed.

    `body` is what goes upstream: the client's bytes, or, for a completion that sent no
    `max_tokens` to a model whose context length is unknown, its JSON with the output cap
    admission assumed made explicit. `data` is
    the parsed JSON of a completion and None for a pass-through request, whose body is
    relayed unread (its `model` is looked for, and None when it has none).
    """

    request_id: str
    priority: Priority
    tenant: str
    max_wait_s: float | None
    body: bytes
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    data: dict[str, Any] | None = None

    @property
    def exact_output(self) -> bool:
        """Runs to exactly its cap (its `max_tokens`, or the engine's when it sent none):
        end-of-sequence ignored (a vLLM/SGLang extension)."""
        data = self.data
        return data is not None and data.get("ignore_eos") is True


@dataclass(slots=True)
class AccessRecord:
    """What the access log and the metrics need to know about one request."""

    request_id: str
    route: str
    started: float
    tenant: str = ""  # its API key's tenant ("" without keys)
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
    # What a completion's cost was made of (None for a pass-through request), kept current
    # when a better count arrives; and the engine's count, while it is still on its way.
    basis: CostBasis | None = None
    late_count: asyncio.Task[PromptCount | None] | None = None
    queued_s: float | None = None  # time spent waiting in the gateway's queue
    reason: str | None = None  # why the gateway answered an error itself
    # Why it went to its backend (`Ticket.route`: `prefix 1536/2048`, `headroom`).
    placement: str | None = None
    # SSE data events relayed so far (a stream's tokens, or more when an engine merges
    # several into one event), and those received after the client's disconnect was noticed.
    events: int = 0
    events_after_disconnect: int = 0
    saw_done: bool = False  # the stream's `data: [DONE]` was relayed


@dataclass(slots=True)
class Call:
    """One admitted request's passage to a backend and back: what each step needs."""

    scope: Scope
    send: Send
    client: ClientRequest
    record: AccessRecord
    cscope: CancelScope
    loop: asyncio.AbstractEventLoop
