"""How long after a client hangs up does the engine see its request closed, through kvgate?

The target: the engine sees the abort within 50 ms of the client's disconnect, on every
path, and produces no further tokens. This measures it end to end:

- the tests' fake engine (`kvgate.testing.FakeEngine`) on 127.0.0.1, in this process, which
  records the moment each request's connection closes and when it wrote each token;
- `kvgate serve` (policy `none`, default settings) in its own process in front of it;
- clients, in this process too (so both timestamps come from one monotonic clock), that
  disconnect at four stages: before the response headers, after the headers but before
  the first token, mid-stream (after 5 tokens at 20 ms/token), and while waiting for a
  non-streamed answer.

    python benchmarks/cancel_propagation/bench.py [--trials 40]   # rewrites results.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson

from kvgate.testing import FakeEngine, eventually, free_port

HERE = Path(__file__).resolve().parent
TOKEN_S = 0.02
STAGES = ("before_headers", "before_first_token", "mid_stream", "non_streaming_wait")


#: How each stage's request asks the fake engine to behave (its `"fake"` knobs): it keeps
#: the request open until the client leaves, at the stage where the client will leave.
KNOBS = {
    "before_headers": {"delay": 10},  # no response headers for 10 s
    "before_first_token": {"chunks": 1, "hang_after": 0},  # headers, then silence
    "mid_stream": {"chunks": 500, "interval": TOKEN_S},  # a token every 20 ms
    "non_streaming_wait": {"chunks": 500, "interval": TOKEN_S},  # answers after 10 s
}


async def one_trial(gateway_port: int, engine: FakeEngine, stage: str) -> tuple[float, int]:
    """Disconnect at `stage`; return (ms until the engine saw the close, tokens after)."""
    rid = uuid.uuid4().hex
    body = orjson.dumps(
        {
            "model": engine.model,
            "prompt": "hi",
            "max_tokens": 500,
            "stream": stage != "non_streaming_wait",
            "fake": KNOBS[stage],
        }
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway_port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (rid.encode(), len(body), body)
    )
    if not await eventually(lambda: any(r.request_id == rid for r in engine.requests), 5):
        raise RuntimeError(f"request {rid} never reached the engine")
    if stage == "before_first_token":
        await reader.readuntil(b"\r\n\r\n")
    elif stage == "mid_stream":
        for _ in range(5):
            await reader.readuntil(b"\n\n")
    else:
        await asyncio.sleep(0.05)
    left_at = time.monotonic()
    writer.transport.abort()  # the client is gone: connection closed at once
    seen = await engine.wait_closed(rid, within=5)
    assert seen.closed_by_client_at is not None
    after = sum(1 for t in seen.chunk_times if t > left_at)
    return (seen.closed_by_client_at - left_at) * 1000, after


async def wait_ready(port: int, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            if b" 200 " in await reader.readline():
                writer.close()
                return
            writer.close()
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("kvgate did not become ready")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(trials: int) -> str:
    engine = await FakeEngine().start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_SERVER__LOG_LEVEL"] = "warning"  # no access lines
    backend = f"http://127.0.0.1:{engine.port}"
    cmd = ["-m", "kvgate.bench.serve", "--baseline", "none", "--port", str(port)]
    cmd += ["--backend", backend]
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, *cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        await wait_ready(port)
        rows = []
        for stage in STAGES:
            delays, tokens = [], 0
            for _ in range(trials):
                delay, after = await one_trial(port, engine, stage)
                delays.append(delay)
                tokens += after
            rows.append(
                f"| {stage} | {trials} | {statistics.median(delays):.2f} | {pct(delays, 0.99):.2f}"
                f" | {max(delays):.2f} | {sum(d <= 50 for d in delays)}/{trials} | {tokens} |"
            )
    finally:
        gateway.terminate()
        await asyncio.wait_for(gateway.wait(), 10)
        await engine.stop()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()},"
            f" Python {platform.python_version()}, load average {load};"
            f" `kvgate serve` with default settings (uvicorn).",
            "",
            "| client disconnects | trials | engine sees close p50 ms | p99 ms | max ms"
            " | within 50 ms | tokens written after the client left |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    table = asyncio.run(run(args.trials))
    print(table)
    doc = (HERE / "results.md").read_text() if (HERE / "results.md").exists() else ""
    head = doc.split("<!-- bench:start -->")[0] if doc else "# Cancellation propagation\n\n"
    tail = doc.split("<!-- bench:end -->")[1] if "<!-- bench:end -->" in doc else "\n"
    (HERE / "results.md").write_text(
        f"{head}<!-- bench:start -->\n{table}\n<!-- bench:end -->{tail}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
