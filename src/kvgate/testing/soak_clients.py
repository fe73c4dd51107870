"""The chaos soak's clients: workers that loop over random actions until the deadline.

Complete and streamed requests, ones cancelled before the response headers, while waiting
for a non-streamed answer or mid-stream, malformed ones and slow ones (half a request
line, then silence). Every answer is checked: a correct completion, a correct stream
ending in `[DONE]` or in an SSE `error` event, or an OpenAI-shaped error with an allowed
status and, for 429/503, a Retry-After; whatever is not is a violation in the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import aiohttp
import orjson

from kvgate.gateway.http.guard import CLIENT_TIMEOUT_S
from kvgate.testing.soak_report import SoakReport

MODEL = "sim-llama"
KEYS = {
    "alpha": ("soak-alpha-key-0123456789", "critical"),
    "beta": ("soak-beta-key-01234567890", "standard"),
    "gamma": ("soak-gamma-key-0123456789", "sheddable"),
}
#: Statuses a well-formed request may get under chaos (each with an OpenAI error body).
#: No 500: neither kvgate's own nor a relayed engine 500 ("the request was aborted by the
#: engine") may reach a client that is still waiting. The engine aborts a request only when
#: its connection closed or kvgate asked it to, both after kvgate gave up on it. (Such 500s
#: were once seen here: the simulator handed a dropped request's abort to the same-id
#: retry kvgate had sent on a fresh connection; `tests/sim/test_server_ids.py`.)
ALLOWED_ERRORS = frozenset({429, 502, 503, 504})

#: Kinds of client behaviour and their weights.
ACTIONS = {
    "complete": 26,
    "stream": 26,
    "cancel_before_headers": 10,
    "cancel_waiting": 10,
    "cancel_mid_stream": 12,
    "malformed": 15,
    "slow_client": 1,
}
#: How long a slow client waits for its 408: the gateway's read deadline plus a margin.
SLOW_CLIENT_WAIT_S = CLIENT_TIMEOUT_S + 10.0


def _headers(rng: random.Random) -> dict[str, str]:
    tenant = rng.choice(list(KEYS))
    headers = {"Authorization": f"Bearer {KEYS[tenant][0]}"}
    if rng.random() < 0.3:
        headers["X-Kvgate-Priority"] = rng.choice(["critical", "standard", "sheddable"])
    return headers


def _body(rng: random.Random, *, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "stream": stream,
                            "max_tokens": max_tokens or rng.randint(1, 24)}  # fmt: skip
    if rng.random() < 0.5:
        body["prompt"] = "soak " * rng.randint(1, 200)
    else:
        body = {**body, "messages": [{"role": "user", "content": "hi " * rng.randint(1, 100)}]}
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    return body


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _malformed(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], int]:
    """(method, path, body, headers, expected status) of one bad request."""
    good = _headers(rng)
    cases: list[tuple[str, str, bytes, dict[str, str], int]] = [
        ("POST", "/v1/completions", b"{not json", good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": -3}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": "9"}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": 1e9}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "max_tokens": 2147483648}', good, 400),
        ("POST", "/v1/chat/completions", b'{"messages": []}', good, 400),
        ("POST", "/v1/completions", b'{"model": "sim-llama", "prompt": "\xff\xfe"}', good, 400),
        ("POST", "/v1/completions", b'{"model": "nope", "prompt": "x"}', good, 404),
        ("POST", "/v1/completions", b"[" + b" " * (70 * 1024) + b"]", good, 413),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}', {}, 401),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}',
         {"Authorization": "Bearer soak-wrong-key-0123456789"}, 401),
        ("POST", "/v1/completions", b'{"model": "sim-llama"}',
         {**good, "X-Kvgate-Priority": "urgent"}, 400),
        ("GET", "/v1/completions", b"", good, 405),
        ("GET", "/admin/state", b"", good, 401),
    ]  # fmt: skip
    return rng.choice(cases)


class Clients:
    """Worker coroutines that each loop over random actions until the deadline."""

    def __init__(self, url: str, report: SoakReport, seed: int) -> None:
        self.url = url
        self.report = report
        self.seed = seed
        self.session: aiohttp.ClientSession | None = None
        self.until = 0.0
        self._slow: set[asyncio.Task[None]] = set()

    async def run(self, workers: int, until: float) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=30)
        self.until = until
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.session = session
            await asyncio.gather(*(self._worker(i, until) for i in range(workers)))
            await asyncio.gather(*self._slow)  # each answered or timed out by now

    async def _worker(self, index: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        kinds, weights = list(ACTIONS), list(ACTIONS.values())
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            kind = rng.choices(kinds, weights)[0]
            if kind == "slow_client" and loop.time() + SLOW_CLIENT_WAIT_S > until:
                continue  # its 408 could not come before the end of the run
            self.report.actions[kind] += 1
            self.report.requests += 1
            try:
                await getattr(self, f"_{kind}")(rng)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                self.report.violation(f"{kind}: client error {type(exc).__name__}: {exc}")

    def _status(self, status: int, resp: aiohttp.ClientResponse | None = None) -> None:
        reason = resp.headers.get("X-Kvgate-Reason") if resp is not None else None
        self.report.statuses[f"{status}:{reason}" if reason else str(status)] += 1

    async def _check_error(self, kind: str, resp: aiohttp.ClientResponse, body: bytes) -> None:
        status = resp.status
        try:
            error = orjson.loads(body)["error"]
            shaped = set(error) == {"message", "type", "param", "code"} and error["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            shaped = False
        if not shaped:
            self.report.violation(f"{kind}: {status} without an OpenAI error body: {body[:200]!r}")
        if status in (429, 503) and "Retry-After" not in resp.headers:
            self.report.violation(f"{kind}: {status} without Retry-After")

    async def _complete(self, rng: random.Random) -> None:
        await self._honest("complete", rng, stream=False)

    async def _stream(self, rng: random.Random) -> None:
        await self._honest("stream", rng, stream=True)

    async def _honest(self, kind: str, rng: random.Random, *, stream: bool) -> None:
        """A well-formed request read to the end: a correct answer or a well-formed error."""
        assert self.session is not None
        body = _body(rng, stream=stream)
        async with self.session.post(
            self.url + _path(body), json=body, headers=_headers(rng)
        ) as resp:
            data = await resp.read()
            self._status(resp.status, resp)
            if resp.status == 200 and stream:
                self._check_stream(data)
            elif resp.status == 200:
                self._check_whole(data)
            elif resp.status in ALLOWED_ERRORS:
                await self._check_error(kind, resp, data)
            else:
                rid = resp.headers.get("X-Request-Id")
                self.report.violation(
                    f"{kind}: unexpected status {resp.status} (id {rid}): {data[:200]!r}"
                )

    def _check_whole(self, data: bytes) -> None:
        parsed = orjson.loads(data)
        if not parsed.get("choices") or "usage" not in parsed:
            self.report.violation(f"complete: 200 without choices/usage: {data[:200]!r}")

    def _check_stream(self, data: bytes) -> None:
        events = [e for e in data.split(b"\n\n") if e.strip()]
        if not events:
            self.report.violation("stream: 200 with an empty body")
            return
        last = events[-1]
        if last.startswith(b"event: error\ndata: "):
            self.report.statuses["200+sse_error"] += 1
            try:
                orjson.loads(last.split(b"data: ", 1)[1])["error"]["code"]
            except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
                self.report.violation(f"stream: malformed error event {last[:200]!r}")
            events = events[:-1]
        elif last != b"data: [DONE]":
            self.report.violation(f"stream: ends without [DONE] or error: {last[-200:]!r}")
            return
        else:
            events = events[:-1]
        for event in events:
            if not event.startswith(b"data: {"):
                self.report.violation(f"stream: odd event {event[:200]!r}")
                return
            try:
                orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                self.report.violation(f"stream: event is not JSON {event[:200]!r}")
                return

    async def _cancel_before_headers(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=rng.random() < 0.5, max_tokens=rng.randint(50, 300))
        task = asyncio.ensure_future(
            self.session.post(self.url + _path(body), json=body, headers=_headers(rng))
        )
        await asyncio.sleep(rng.uniform(0.0, 0.02))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            resp = await task
            resp.close()  # answered before we gave up (a quick 429, say): drop it anyway

    async def _cancel_waiting(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=False, max_tokens=rng.randint(100, 400))
        body["ignore_eos"] = True

        async def call() -> None:
            assert self.session is not None
            async with self.session.post(
                self.url + _path(body), json=body, headers=_headers(rng)
            ) as resp:
                await resp.read()

        task = asyncio.ensure_future(call())
        await asyncio.sleep(rng.uniform(0.02, 0.4))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _cancel_mid_stream(self, rng: random.Random) -> None:
        assert self.session is not None
        body = _body(rng, stream=True, max_tokens=rng.randint(50, 400))
        body["ignore_eos"] = True
        async with self.session.post(
            self.url + _path(body), json=body, headers=_headers(rng)
        ) as resp:
            self._status(resp.status, resp)
            if resp.status != 200:
                await self._check_error("cancel_mid_stream", resp, await resp.read())
                return
            wanted = rng.randint(1, 6)
            seen = 0
            async for _ in resp.content.iter_any():
                seen += 1
                if seen >= wanted:
                    break
            resp.close()  # drop the connection mid-stream

    async def _malformed(self, rng: random.Random) -> None:
        assert self.session is not None
        method, path, data, headers, expected = _malformed(rng)
        headers = {**headers, "Content-Type": "application/json"}
        async with self.session.request(method, self.url + path, data=data, headers=headers) as r:
            body = await r.read()
            self._status(r.status)
            if r.status != expected:
                self.report.violation(f"malformed {path} {data[:60]!r}: {r.status} != {expected}")
            await self._check_error("malformed", r, body)

    async def _slow_client(self, rng: random.Random) -> None:
        """Half a request line, then silence: the 408 comes after the gateway's read
        deadline, so the client waits for it in a task of its own and the worker goes on."""
        task = asyncio.create_task(self._stalled_request())
        self._slow.add(task)
        task.add_done_callback(self._slow.discard)

    async def _stalled_request(self) -> None:
        host, _, port = self.url.removeprefix("http://").rpartition(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            self.report.violation(f"slow_client: client error {type(exc).__name__}: {exc}")
            return
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
            await writer.drain()
            async with asyncio.timeout(SLOW_CLIENT_WAIT_S):
                answer = await reader.read()
        except (TimeoutError, OSError) as exc:
            self.report.violation(f"slow_client: client error {type(exc).__name__}: {exc}")
            return
        finally:
            writer.close()
        self._status(408 if answer.startswith(b"HTTP/1.1 408") else 0)
        if not answer.startswith(b"HTTP/1.1 408"):
            self.report.violation(f"slow_client: expected 408, got {answer[:80]!r}")
