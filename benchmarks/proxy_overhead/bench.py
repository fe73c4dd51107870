"""What does the gateway cost? CPU per request, CPU per 1,000 SSE chunks, added TTFT.

Side by side, in one run, on one fast fake engine:

- `direct`: the client talks to the engine (the TTFT baseline; no proxy CPU).
- `nginx`: `proxy_buffering off`, HTTP/1.1 keep-alive upstream, access log off.
- `kvgate-uvicorn-native`: `kvgate serve` (uvloop + httptools; its relay client is kvgate's
  keep-alive HTTP/1.1 pool on httptools, `-native` in every stack's name), its policy
  (`adaptive`), access log on (written to a file), the scraper polling the engine.
- `kvgate-hypercorn-native`: the same app under hypercorn (the HTTP/2 server), HTTP/1.1.
- `kvgate-granian-native`: the same app under granian's ASGI interface (if installed).
- `floor-uvicorn-h1pool`: uvicorn and kvgate's upstream client relaying blindly
  (`floor_app.py`): what kvgate would cost if its own code were free.

The engine is this file's own (`engine_main`), not `kvgate.testing.FakeEngine`: it runs in
a process of its own, answers from pre-built bytes, keeps its connections alive after a
stream and reads `token_ms` from the body, so that it costs the machine as little as it
can and every stack is measured against the same engine the committed figures were.

Each proxy is its own process tree; its CPU time is read from `/proc/<pid>/task/*/schedstat`
(nanoseconds, all threads, all child processes) before and after each phase. The client and
the engine are separate processes too, so the figures are the proxy's own work.

Phases per stack:
1. `nonstream`: `--requests` small non-streaming completions over 16 keep-alive
   connections; CPU per request.
2. `stream`: `--streams` concurrent streams of `--tokens` events at `--token-ms` per event,
   each connection starting a new stream when its last ends, for `--duration` seconds;
   CPU per 1,000 relayed chunks and TTFT (request written -> first `data:` byte read).
3. `fast streams`: `--fast-streams` streams whose events come back to back
   (`--fast-token-ms`, 0.05 ms), so a proxy's reads carry several events each; CPU per
   1,000 chunks. This is the regime of the reference figure (3.6 ms per 1,000 chunks for
   nginx): nginx measures it here, against ~25 ms when every event arrives on its own
   20 ms tick (phase 2), where each event costs a wake-up, a read and a write.

Usage::

    python benchmarks/proxy_overhead/bench.py run            # writes results.md beside it
    python benchmarks/proxy_overhead/bench.py run --only kvgate-uvicorn-native --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.testing import free_port

HERE = Path(__file__).resolve().parent
MODEL = "bench-model"
EVENT = (
    b'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench-model",'
    b'"choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null}]}\n\n'
)
USAGE = (
    b'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench-model",'
    b'"choices":[],"usage":{"prompt_tokens":12,"total_tokens":%d,"completion_tokens":%d}}\n\n'
)
DONE = b"data: [DONE]\n\n"
NONSTREAM_BODY = (
    b'{"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench-model",'
    b'"choices":[{"index":0,"text":" a short answer","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":12,"total_tokens":16,"completion_tokens":4}}'
)
METRICS = (
    b'vllm:kv_cache_usage_perc{engine="0",model_name="bench-model"} 0.05\n'
    b'vllm:num_requests_running{engine="0",model_name="bench-model"} 1\n'
    b'vllm:num_requests_waiting{engine="0",model_name="bench-model"} 0\n'
    b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100000"} 1.0\n'
)


# ---- the fake engine (its own process) ------------------------------------------------------


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def engine_main(port: int, token_ms: float) -> None:
    """A fast OpenAI-ish engine: instant non-streaming answers; streams emit one event per
    `token_ms` per stream, the first `token_ms` after the request (like one decode step)."""
    loop = asyncio.get_running_loop()
    interval = token_ms / 1000

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                path = head.split(b" ", 2)[1]
                if path == b"/metrics":
                    writer.write(_response(200, METRICS, b"text/plain"))
                elif path == b"/v1/models":
                    models = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                    writer.write(_response(200, models))
                elif path == b"/health":
                    writer.write(_response(200, b""))
                elif b'"stream":true' in body or b'"stream": true' in body:
                    tokens = int(_field(body, b'"max_tokens":'))
                    pace = (
                        float(_field(body, b'"token_ms":')) / 1000
                        if b'"token_ms":' in body
                        else interval
                    )
                    await _stream(writer, tokens, pace, loop)
                else:
                    writer.write(_response(200, NONSTREAM_BODY))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, IndexError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def _field(body: bytes, key: bytes) -> bytes:
    """The raw value after `key` in a flat JSON body (the bench's own requests only)."""
    return body.split(key, 1)[1].split(b",", 1)[0].strip(b" }")


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        ctype,
        len(body),
        body,
    )


async def _stream(
    writer: asyncio.StreamWriter, tokens: int, interval: float, loop: asyncio.AbstractEventLoop
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    done = loop.create_future()
    start = loop.time()
    sent = 0

    def tick() -> None:
        nonlocal sent
        if writer.is_closing():
            done.set_result(None)
            return
        writer.write(_chunk(EVENT))
        sent += 1
        if sent < tokens:
            loop.call_at(start + (sent + 1) * interval, tick)
        else:
            writer.write(_chunk(USAGE % (12 + tokens, tokens)) + _chunk(DONE) + b"0\r\n\r\n")
            done.set_result(None)

    loop.call_at(start + interval, tick)
    await done


# ---- CPU accounting ------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants (via /proc/*/stat parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of the process tree, all threads, from schedstat (ns resolution)."""
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    total += int(Path(f"/proc/{p}/task/{task}/schedstat").read_text().split()[0])
    return total / 1e9


# ---- the client ----------------------------------------------------------------------------


def _request(port: int, body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (port, len(body), body)
    )


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    if b"content-length:" in lower:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        return head + await reader.readexactly(length)
    data = head
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("closed mid-response")
        data += chunk
    return data


async def nonstream_phase(
    port: int, requests: int, statuses: Counter[int] | None = None, connections: int = 16
) -> float:
    """Send `requests` non-streaming completions; returns the wall time. Answers other
    than 200 are counted in `statuses` (a refusal carries a body: the connection goes on)."""
    body = json.dumps({"model": MODEL, "prompt": "hello world", "max_tokens": 4}).encode()
    payload = _request(port, body)
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while remaining > 0:
                remaining -= 1
                writer.write(payload)
                response = await _read_response(reader)
                if not response.startswith(b"HTTP/1.1 200"):
                    if statuses is None:
                        raise RuntimeError(response[:200].decode(errors="replace"))
                    statuses[int(response[9:12])] += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return time.perf_counter() - start


@dataclass
class StreamResult:
    ttft_s: list[float] = field(default_factory=list)
    chunks: int = 0
    streams: int = 0
    errors: int = 0
    statuses: Counter[int] = field(default_factory=Counter)  # answers other than 200


async def stream_phase(
    port: int,
    streams: int,
    tokens: int,
    duration: float,
    spread_s: float = 0.02,
    token_ms: float | None = None,
) -> StreamResult:
    """`streams` connections, each running streams back to back for `duration` seconds.

    The connections start `spread_s / streams` apart. Over one token period (the default)
    they start, and then restart, in waves of `streams` requests within 20 ms, which
    measures how a burst queues behind the proxy's per-request cost; spread over a whole
    stream's life they arrive evenly, the steady state of `streams` concurrent streams.
    `token_ms` overrides the engine's pace for these streams.
    """
    request: dict[str, object] = {
        "model": MODEL,
        "prompt": "hello world",
        "max_tokens": tokens,
        "stream": True,
    }
    if token_ms is not None:
        request["token_ms"] = token_ms
    body = json.dumps(request).encode()
    payload = _request(port, body)
    result = StreamResult()
    stop_at = time.perf_counter() + duration

    async def worker(offset: float) -> None:
        await asyncio.sleep(offset)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                sent = time.perf_counter()
                writer.write(payload)
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    result.errors += 1
                    result.statuses[int(head[9:12])] += 1
                    return
                data = b""
                first = True
                while not data.endswith(b"\r\n0\r\n\r\n"):
                    chunk = await reader.read(65536)
                    if not chunk:
                        raise ConnectionError("closed mid-stream")
                    if first and b"data:" in chunk:
                        result.ttft_s.append(time.perf_counter() - sent)
                        first = False
                    data = data[-16:] + chunk
                    result.chunks += chunk.count(b"data:")
                result.streams += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker(i * spread_s / streams) for i in range(streams)))
    return result


# ---- the stacks under test ---------------------------------------------------------------------


def wait_port(port: int, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _nginx_conf(workdir: Path, port: int, engine_port: int) -> Path:
    conf = workdir / "nginx.conf"
    conf.write_text(
        f"""worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    upstream engine {{ server 127.0.0.1:{engine_port}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""
    )
    return conf


def stack_env(engine_port: int) -> dict[str, str]:
    """The environment of a `kvgate serve` in front of the fake engine (no KVGATE_* leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.update(
        KVGATE_BACKENDS=json.dumps([{"url": f"http://127.0.0.1:{engine_port}"}]),
        KVGATE_SERVER__LOG_LEVEL="warning",
    )
    return env


def none_command(port: int, src: str, env: dict[str, str]) -> list[str]:
    """A gateway with the `none` baseline (the relay's cost without admission's), imported
    from the tree `src` ("": this one): the benchmark's own gateway where that tree has it,
    else `kvgate serve` with the `admission.policy` setting of older trees (set in `env`)."""
    tree = Path(src) if src else Path(__file__).resolve().parents[2] / "src"
    if (tree / "kvgate" / "bench" / "serve.py").exists():
        return [
            sys.executable,
            "-m",
            "kvgate.bench.serve",
            "--baseline",
            "none",
            "--port",
            str(port),
        ]
    env["KVGATE_ADMISSION__POLICY"] = "none"
    return [sys.executable, "-m", "kvgate", "serve", "--port", str(port)]


def floor_command(port: int, engine_port: int, env: dict[str, str]) -> list[str]:
    """uvicorn serving `floor_app.py` (kvgate's upstream client, none of its logic)."""
    env["FLOOR_UPSTREAM"] = f"http://127.0.0.1:{engine_port}"
    return [
        sys.executable, "-m", "uvicorn", "--app-dir", str(HERE), "floor_app:app",
        "--port", str(port), "--loop", "uvloop", "--http", "httptools",
        "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip


# `--pin`: the proxy alone on one core, the client and the engine on the others. This is
# the deployment kvgate plans (one gateway process per core); it keeps the proxy from
# waiting for a core the load generator holds. On a 2-core machine the load side then has
# one core and becomes the bottleneck (see results.md), so it is an option, not the default.
PROXY_CPU = 1


def _on_proxy_cpu() -> None:
    os.sched_setaffinity(0, {PROXY_CPU})  # in the child, before exec: its tree inherits it


@contextlib.contextmanager
def start_stack(
    name: str,
    engine_port: int,
    workdir: Path,
    before_src: str = "",
    pin: bool = False,
) -> Iterator[tuple[int, int | None]]:
    """Start the proxy `name`; yields (port clients use, pid whose tree is the proxy).

    A name ending in `-before` runs the same stack with kvgate imported from `before_src`.
    With `pin`, the proxy's process tree runs on `PROXY_CPU` only.
    """
    if name == "direct":
        yield engine_port, None
        return
    port = free_port()
    env = stack_env(engine_port)
    log = open(workdir / f"{name}.log", "wb")
    if name.endswith("-before"):  # the same stack from another source tree (--before-src)
        env["PYTHONPATH"] = before_src
        name = name.removesuffix("-before")
    if name == "nginx":
        command = ["nginx", "-c", str(_nginx_conf(workdir, port, engine_port)), "-p", str(workdir)]
    elif name == "floor-uvicorn-h1pool":
        command = floor_command(port, engine_port, env)
    elif name.startswith("kvgate-granian"):
        env["KVGATE_BENCH_ACCESS_LOG"] = str(workdir / f"{name}.access.log")
        command = [
            sys.executable, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
            "--port", str(port), "--loop", "uvloop", "--http", "1", "--workers", "1",
            "--no-ws", "--log-level", "warning", "--working-dir", str(HERE),
            "granian_app:app",
        ]  # fmt: skip
    else:
        server = name.removeprefix("kvgate-").removesuffix("-native")
        command = [
            sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--server", server,
        ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_on_proxy_cpu if pin else None,  # safe: the bench starts no threads
    )
    try:
        wait_port(port)
        time.sleep(1.0)  # let the scraper and the model catalog warm up
        yield port, process.pid
    finally:
        process.send_signal(signal.SIGTERM if name != "nginx" else signal.SIGQUIT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@dataclass
class StackResult:
    name: str
    cpu_per_request_ms: float | None = None
    requests_per_s: float = 0.0
    cpu_per_1k_chunks_ms: float | None = None
    chunks: int = 0
    streams: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    stream_errors: int = 0
    # Answers other than 200 over every phase and round, by status ("503": 3); the bench
    # must run under the default policy without a single 503.
    refused: Counter[int] = field(default_factory=Counter)
    cpu_best_ms: float | None = None
    cpu_per_1k_fast_chunks_ms: float | None = None


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def measure(name: str, engine_port: int, args: argparse.Namespace, workdir: Path) -> StackResult:
    result = StackResult(name)
    stack = start_stack(name, engine_port, workdir, args.before_src or "", args.pin)
    with stack as (port, pid):
        asyncio.run(nonstream_phase(port, 200, result.refused))  # warm-up: connections, caches
        before = cpu_seconds(pid) if pid else 0.0
        wall = asyncio.run(nonstream_phase(port, args.requests, result.refused))
        if pid:
            result.cpu_per_request_ms = (cpu_seconds(pid) - before) / args.requests * 1e3
        result.requests_per_s = args.requests / wall
        profiler = _start_profiler(pid, name, args, workdir) if args.profile and pid else None
        before = cpu_seconds(pid) if pid else 0.0
        spread = args.token_ms / 1e3 * (args.tokens if args.starts == "even" else 1)
        streamed = asyncio.run(stream_phase(port, args.streams, args.tokens, args.duration, spread))
        if pid:
            result.cpu_per_1k_chunks_ms = (cpu_seconds(pid) - before) / streamed.chunks * 1e6
        if profiler is not None:
            profiler.wait(60)
        if pid and args.fast_streams:
            before = cpu_seconds(pid)
            fast = asyncio.run(
                stream_phase(
                    port, args.fast_streams, args.fast_tokens, args.fast_duration,
                    token_ms=args.fast_token_ms,
                )
            )  # fmt: skip
            result.cpu_per_1k_fast_chunks_ms = (cpu_seconds(pid) - before) / fast.chunks * 1e6
            result.refused.update(fast.statuses)
    result.chunks, result.streams = streamed.chunks, streamed.streams
    result.ttft_p50_ms = _pct(streamed.ttft_s, 0.50) * 1e3
    result.ttft_p99_ms = _pct(streamed.ttft_s, 0.99) * 1e3
    result.stream_errors = streamed.errors
    result.refused.update(streamed.statuses)
    return result


def _start_profiler(
    pid: int, name: str, args: argparse.Namespace, workdir: Path
) -> subprocess.Popen[bytes] | None:
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        print("py-spy not installed: no profile", file=sys.stderr)
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = HERE / f"profile-{name}.txt"
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--duration", str(int(args.duration)),
         "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    stacks = [
        "direct",
        "nginx",
        "kvgate-uvicorn-native",
        "kvgate-hypercorn-native",
        "kvgate-granian-native",
        "floor-uvicorn-h1pool",
    ]
    if args.before_src:
        stacks.insert(stacks.index("kvgate-uvicorn-native"), "kvgate-uvicorn-native-before")
    if shutil.which("nginx") is None:
        stacks.remove("nginx")
        print("nginx not installed: skipped", file=sys.stderr)
    try:
        import granian  # noqa: F401
    except ImportError:
        stacks.remove("kvgate-granian-native")
    if args.only:
        stacks = [s for s in stacks if s in args.only.split(",") or s == "direct"]
    if args.pin:
        load_cpus = os.sched_getaffinity(0) - {PROXY_CPU}
        if not load_cpus:
            raise SystemExit(f"--pin needs CPU {PROXY_CPU} and at least one other")
        os.sched_setaffinity(0, load_cpus)  # this client, and the engine started below
    engine_port = free_port()
    engine = subprocess.Popen(
        [sys.executable, __file__, "engine", "--port", str(engine_port),
         "--token-ms", str(args.token_ms)],
    )  # fmt: skip
    rounds: dict[str, list[StackResult]] = {name: [] for name in stacks}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    try:
        wait_port(engine_port)
        with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
            # Rounds interleave the stacks so that a burst of load from elsewhere on a
            # shared machine hits them all alike; each figure is the median of the rounds.
            for round_no in range(args.rounds):
                for name in stacks:
                    workdir = Path(tmp) / f"{name}-{round_no}"
                    workdir.mkdir()
                    print(f"round {round_no + 1}: {name} ...", file=sys.stderr, flush=True)
                    rounds[name].append(measure(name, engine_port, args, workdir))
                    print(json.dumps(rounds[name][-1].__dict__), file=sys.stderr, flush=True)
    finally:
        engine.terminate()
        engine.wait(10)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    results = [_median(name, rs) for name, rs in rounds.items()]
    args.load = f"load average {' '.join(load_before)} before, {' '.join(load_after)} after"
    report = render(results, args)
    print(report)
    if not args.only and args.write:
        _write_results(report, "bench" if args.starts == "waves" else "bench-even")
    return 0


def _write_results(report: str, marker: str) -> None:
    """Replace the table between the markers in results.md, keeping the prose around it."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    path = HERE / "results.md"
    text = path.read_text() if path.exists() else f"{start}\n{end}\n"
    if start not in text or end not in text:
        text += f"\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{report}{end}{tail}")


def _median(name: str, results: list[StackResult]) -> StackResult:
    """Median of every figure over the rounds; `cpu_best` keeps the lowest CPU/request."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out = StackResult(name)
    for key in StackResult.__dataclass_fields__:
        if key not in ("name", "refused"):
            value = med([getattr(r, key) for r in results])
            setattr(out, key, value if value is not None else getattr(out, key))
    out.cpu_best_ms = min(
        (r.cpu_per_request_ms for r in results if r.cpu_per_request_ms is not None),
        default=None,
    )
    for r in results:
        out.refused.update(r.refused)
    return out


_STARTS = {
    "waves": "in waves (all streams within one token period)",
    "even": "evenly (spread over one stream's life)",
}


def render(results: list[StackResult], args: argparse.Namespace) -> str:
    base = next((r for r in results if r.name == "direct"), None)

    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| stack | CPU ms / request (best) | req/s | CPU ms / 1,000 chunks"
        " | CPU ms / 1,000 chunks, fast streams | TTFT p50 ms"
        " | TTFT p99 ms | added TTFT p50 / p99 ms | streams | errors | not 200 (all rounds) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results:
        added = "-"
        if base is not None and r is not base:
            p50 = r.ttft_p50_ms - base.ttft_p50_ms
            p99 = r.ttft_p99_ms - base.ttft_p99_ms
            added = f"{p50:+.2f} / {p99:+.2f}"
        lines.append(
            f"| {r.name} | {fmt(r.cpu_per_request_ms)} ({fmt(r.cpu_best_ms)}) |"
            f" {r.requests_per_s:,.0f} | {fmt(r.cpu_per_1k_chunks_ms, 2)} |"
            f" {fmt(r.cpu_per_1k_fast_chunks_ms, 2)} |"
            f" {r.ttft_p50_ms:.2f} | {r.ttft_p99_ms:.2f} | {added} | {r.streams:.0f} |"
            f" {r.stream_errors:.0f} |"
            f" {', '.join(f'{k}: {v}' for k, v in sorted(r.refused.items())) or 'none'} |"
        )
    pinned = (
        f"the proxy pinned to CPU {PROXY_CPU}, the client and the engine to the others; "
        if args.pin
        else ""
    )
    setup = (
        f"{args.requests} non-streaming requests over 16 keep-alive connections; "
        f"{args.streams} concurrent streams x {args.tokens} tokens at {args.token_ms:g} ms/token "
        f"for {args.duration:g} s, starting {_STARTS[args.starts]}; fast streams: "
        f"{args.fast_streams} x {args.fast_tokens} tokens at {args.fast_token_ms:g} ms/token "
        f"for {args.fast_duration:g} s; "
        f"kvgate policy `adaptive`, access log on; {pinned}"
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')};"
        f" median of {args.rounds} interleaved rounds; {args.load}"
    )
    return "\n".join([f"Setup: {setup}.", "", *lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    eng = sub.add_parser("engine", help="run the fake engine (used by `run`)")
    eng.add_argument("--port", type=int, required=True)
    eng.add_argument("--token-ms", type=float, default=20.0)
    bench = sub.add_parser("run", help="measure every stack and print a Markdown table")
    bench.add_argument("--requests", type=int, default=5000)
    bench.add_argument("--streams", type=int, default=100)
    bench.add_argument("--tokens", type=int, default=50)
    bench.add_argument("--token-ms", type=float, default=20.0)
    bench.add_argument("--duration", type=float, default=8.0)
    bench.add_argument("--fast-streams", type=int, default=20, help="0: no fast-stream phase")
    bench.add_argument("--fast-tokens", type=int, default=500)
    bench.add_argument("--fast-token-ms", type=float, default=0.05)
    bench.add_argument("--fast-duration", type=float, default=3.0)
    bench.add_argument(
        "--starts",
        choices=("waves", "even"),
        default="waves",
        help="streams start in waves within one token period, or evenly over a stream's life",
    )
    bench.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    bench.add_argument(
        "--before-src",
        help="also run kvgate-uvicorn-native from this source tree (a git worktree of an "
        "older commit), as kvgate-uvicorn-native-before: an A/B in the same rounds",
    )
    bench.add_argument("--only", help="comma-separated stacks (direct always runs)")
    bench.add_argument(
        "--pin",
        action="store_true",
        help=f"the proxy alone on CPU {PROXY_CPU}; the client and the engine on the others",
    )
    bench.add_argument("--profile", action="store_true", help="py-spy the proxy while streaming")
    bench.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args()
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    if args.command == "engine":
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            with contextlib.suppress(KeyboardInterrupt):
                runner.run(engine_main(args.port, args.token_ms))
        return 0
    if loop_factory is not None:
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
