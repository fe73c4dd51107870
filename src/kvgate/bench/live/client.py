"""The clients of a live run: users that stream `/v1/completions` and behave as in the
virtual runs.

Each user request is an asyncio task that sends streaming `/v1/completions` with a token-id
prompt (exact length on every engine) and `ignore_eos`, so the work asked for is the same
whatever the engine. The client behaves as `ClientModel` says: when its deadline passes it
closes the connection (a real disconnect the engine or gateway sees); a timeout or 5xx is
retried; a 429 waits out `Retry-After`; after N tries it gives up. A client that says its
timeout sends it as a proxy in front with a route timeout does (Envoy's
`x-envoy-expected-rq-timeout-ms`: the whole answer's time, which is what these clients
wait for).

Clients count the tokens they read exactly (`return_token_ids`, a vLLM extension other
engines ignore): vLLM merges several tokens into one event when its server lags, so
counting events undercounts what a client that leaves early had read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson

from kvgate.bench.metrics import ERROR, OK, SHED, TIMEOUT, UNAVAILABLE, Attempt, UserRequest
from kvgate.bench.workload import Arrival
from kvgate.sim.runs import ClientModel


@dataclass
class LiveTarget:
    """Where clients send requests (a gateway, or the engines themselves for `direct`)."""

    urls: list[str]  # clients spread over these round-robin (one URL: a gateway)
    engines: list[str]  # engine base URLs, for their metrics pages
    model: str
    zombie_from_counter: bool = True  # False: estimate zombies as generated - delivered
    gateway: str | None = None  # polled at /admin/state and /metrics for its queue


@dataclass
class ClientRun:
    """What the client tasks of one live run share: the clock origin, the rotation over the
    target's URLs, the retry draws, and the tally of what the clients got."""

    t0: float
    delivered: int = 0  # output tokens clients read, whole answers and cut-off ones
    delivered_whole: int = 0  # `usage.completion_tokens` of the answers read to the end
    departures: int = 0  # attempts the client left (timeout) or lost (error) before the end
    departed_midstream: int = 0  # ... of which after reading at least one token
    departed_events: int = 0  # SSE events with tokens those clients read before leaving
    departed_tokens: int = 0  # tokens in those events (`token_ids`)
    log: list[dict[str, object]] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    rr: int = 0
    retry_rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    says_timeout: bool = False  # each try carries its deadline (`x-envoy-expected-rq-timeout-ms`)

    def now(self) -> float:
        return time.monotonic() - self.t0


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic token-id prompt of length n (ids clear of special tokens)."""
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.integers(100, 8000, n)]


async def one_attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    start: float,
    deadline_s: float,
    shared: ClientRun,
    req_id: str,
) -> Attempt:
    """Send once; stream the answer until done, refusal, error or the client's deadline."""
    first: float | None = None
    read = StreamRead()
    headers = {"Content-Type": "application/json", "X-Request-Id": req_id}
    if shared.says_timeout:
        headers["x-envoy-expected-rq-timeout-ms"] = str(max(1, round(deadline_s * 1000)))
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
                if resp.status in (429, 503):
                    await resp.read()
                    return _refused(shared, req_id, start, resp)
                if resp.status >= 300:
                    await resp.read()
                    return Attempt(start, shared.now(), ERROR)
                async for raw in resp.content:
                    if read.feed(raw) and first is None:
                        first = shared.now()
                    if read.done:
                        break
                outcome = OK if read.done and read.usage is not None else ERROR
                tokens = read.usage if read.usage is not None else read.tokens
                return _end(shared, req_id, start, outcome, first, tokens, read)
    except TimeoutError:
        # Leaving the `async with` closed the connection: the server sees a disconnect.
        return _end(shared, req_id, start, TIMEOUT, first, read.tokens, read)
    except (aiohttp.ClientError, OSError, ValueError):
        return _end(shared, req_id, start, ERROR, first, read.tokens, read)


def _refused(shared: ClientRun, req_id: str, start: float, resp: aiohttp.ClientResponse) -> Attempt:
    """A 429/503: note why (`X-Kvgate-Reason`) and when to come back."""
    ra = _retry_after(resp.headers)
    outcome = SHED if resp.status == 429 else UNAVAILABLE
    reason = resp.headers.get("x-kvgate-reason")
    shared.refusals[reason or str(resp.status)] += 1
    entry = {"id": req_id, "outcome": outcome, "start": round(start, 3), "reason": reason}
    shared.log.append({**entry, "retry_after": ra})
    return Attempt(start, shared.now(), outcome, retry_after_s=ra)


@dataclass
class StreamRead:
    """What a client read of one streamed answer: events, tokens in them, usage, the end."""

    chunks: int = 0
    tokens: int = 0
    usage: int | None = None
    done: bool = False
    error: bool = False

    def feed(self, raw: bytes) -> bool:
        """Take one line of the stream; True when it carried output tokens."""
        line = raw.strip()
        if line.startswith(b"event:") and b"error" in line:
            self.error = True
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return False
        chunk = orjson.loads(data)
        if chunk.get("usage"):
            self.usage = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices")
        if not choices:
            return False
        self.chunks += 1
        # An event may carry several tokens when the engine's server lags behind its
        # engine (vLLM merges queued outputs): `token_ids` says how many, when asked for.
        ids = choices[0].get("token_ids")
        self.tokens += len(ids) if isinstance(ids, list) else 1
        return True


def _end(
    shared: ClientRun,
    req_id: str,
    start: float,
    outcome: str,
    first: float | None,
    tokens: int,
    read: StreamRead,
) -> Attempt:
    """Count what the client got and note every attempt that got less than a whole answer."""
    end = shared.now()
    shared.delivered += tokens
    if outcome == OK:
        shared.delivered_whole += tokens
    else:
        shared.departures += 1
        shared.departed_midstream += read.tokens > 0
        shared.departed_events += read.chunks
        shared.departed_tokens += read.tokens
        shared.log.append(
            {
                "id": req_id,
                "outcome": outcome,
                "start": round(start, 3),
                "end": round(end, 3),
                "first_token": None if first is None else round(first, 3),
                "chunks": read.chunks,
                "tokens_read": read.tokens,
                "error_event": read.error,
            }
        )
    return Attempt(start, end, outcome, first, tokens)


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """`retry-after-ms` if given (finer), else `Retry-After` in seconds."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        with contextlib.suppress(ValueError):
            return float(ms) / 1000.0
    sec = headers.get("Retry-After")
    if sec is not None:
        with contextlib.suppress(ValueError):
            return float(sec)
    return None


async def play_user(
    session: aiohttp.ClientSession,
    arrival: Arrival,
    client: ClientModel,
    target: LiveTarget,
    shared: ClientRun,
    prompt: list[int],
    stop_at: float,
) -> UserRequest:
    """One user: wait for the arrival time, then try until served, out of tries or time."""
    await asyncio.sleep(max(0.0, arrival.t - shared.now()))
    user = UserRequest(
        arrival.id,
        arrival.kind,
        shared.now(),
        arrival.prompt_tokens,
        arrival.max_tokens,
        client.timeout_s,
    )
    payload = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": arrival.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM: each event lists its tokens (exact count on leaving)
        "ignore_eos": True,
        "temperature": 0.0,
    }
    body = orjson.dumps(payload)
    for n in range(1, client.max_attempts + 1):
        url = target.urls[shared.rr % len(target.urls)]
        shared.rr += 1
        start = shared.now()
        deadline = min(client.timeout_s, max(0.1, stop_at - start))
        attempt = await one_attempt(
            session, url, body, start, deadline, shared, f"{arrival.id}-{n}"
        )
        user.attempts.append(attempt)
        if attempt.outcome == OK or n == client.max_attempts:
            break
        if attempt.outcome in (SHED, UNAVAILABLE):
            wait = attempt.retry_after_s if client.honor_retry_after else None
            delay = wait if wait is not None else client.retry_delay(n, shared.retry_rng)
        else:
            delay = client.retry_delay(n, shared.retry_rng)
        if shared.now() + delay >= stop_at:
            break
        await asyncio.sleep(delay)
    return user
