"""The floor under kvgate's relay: uvicorn plus kvgate's upstream client and nothing else.

No parsing, admission, routing, cancellation, metrics or logs: read the request, send it
to the one upstream with `H1Pool`, relay the answer (chunk by chunk when it streams).
`bench.py` runs it as the `floor-uvicorn-h1pool` stack, side by side with `kvgate serve`,
so that the table shows how much of kvgate's cost is its own logic and how much is the
server and client it stands on. Not a proxy anyone should run: it forwards blindly.
Run as `uvicorn --app-dir benchmarks/proxy_overhead floor_app:app` with `FLOOR_UPSTREAM`.
"""

from __future__ import annotations

import os
from typing import Any

from kvgate.gateway.http.h1client import H1Pool

UPSTREAM = os.environ.get("FLOOR_UPSTREAM", "http://127.0.0.1:8000")
_HOP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}
_pool: H1Pool | None = None


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global _pool
    if scope["type"] != "http":
        return
    if _pool is None:
        _pool = H1Pool(5.0)
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    headers = [(k, v) for k, v in scope["headers"] if k not in _HOP]
    body = b"".join(parts)
    response = await _pool.request(UPSTREAM, scope["method"], scope["path"], headers, body)
    out = [(k, v) for k, v in response.raw_headers if k.lower() not in _HOP]
    if response.content_type.startswith("text/event-stream"):
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        while chunk := await response.readany():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    else:
        data = await response.read()
        out.append((b"content-length", b"%d" % len(data)))
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        await send({"type": "http.response.body", "body": data})
    response.release()
