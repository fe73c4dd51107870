"""What the engine's own count costs: `/tokenize` latency, kvgate's CPU, the engine's CPU.

kvgate asks one engine `POST /tokenize` for each prompt it has no tokenizer for
(kvgate.gateway.tokens.engine), through the relay's keep-alive pool. This measures, against
a running engine (`--url`, e.g. the real vLLM of scripts/real-vllm/serve.sh, or by default
a `kvgate sim` engine started here):

- the latency a request waits for its count, p50 and p99 (`EngineCounter.ask`, as the
  relay awaits it), sequentially and with `--concurrency` requests at once;
- kvgate's CPU per count (`time.process_time` of this process over the calls, on uvloop
  as `kvgate serve` runs: the call, the event loop's part in it, the answer's parsing);
- the extra CPU on the engine: the CPU time (`/proc/PID/stat`, user + system) of the
  engine's API server (the process `--pid` names, which serves `/tokenize`) and of its
  descendants (vLLM's engine core, which polls while it waits: its CPU follows the wall
  time), over N completions (`max_tokens` 1) alone, and over the same N each after its
  `/tokenize`.

Prompts are chats and completions of `--chars` characters of distinct text (the docs';
the mean tokens the engine counted for them is printed).

    python benchmarks/cost_exact/engine_count.py [--url URL --pid PID] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvloop

from kvgate.adapters.backend import Backend
from kvgate.adapters.settings import BackendSettings
from kvgate.gateway.relay.upstream import UpstreamPool
from kvgate.gateway.tokens.engine import EngineCounter
from kvgate.procs.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of `pid` itself (vLLM's API server, which serves
    `/tokenize`), and of its descendants alive now (vLLM's engine core)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))

    def own(current: int) -> float:
        fields = stats.get(current)
        return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / TICKS

    below, todo = 0.0, list(children.get(pid, []))
    while todo:
        current = todo.pop()
        below += own(current)
        todo.extend(children.get(current, []))
    return own(pid), below


def prompts(count: int, chars: int) -> list[dict[str, Any]]:
    text = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    out: list[dict[str, Any]] = []
    for i in range(count):
        at = (i * 997 * 7) % max(1, len(text) - chars)
        piece = text[at : at + chars]
        if i % 2:
            out.append({"messages": [{"role": "user", "content": piece}]})
        else:
            out.append({"prompt": piece})
    return out


async def counts(
    counter: EngineCounter, backend: Backend, model: str, bodies: list[dict[str, Any]], at_once: int
) -> tuple[list[float], float]:
    """Each body's `/tokenize` latency, and kvgate's CPU seconds for them all."""
    latencies: list[float] = []
    sizes: list[int] = []
    gate = asyncio.Semaphore(at_once)

    async def one(body: dict[str, Any]) -> None:
        async with gate:
            payload = counter.request_body(model, body)
            assert payload is not None
            started = time.perf_counter()
            count = await counter.ask(backend, payload)
            latencies.append(time.perf_counter() - started)
            assert count is not None, "the engine gave no count"
            sizes.append(count.per_prompt[0])

    cpu = time.process_time()
    await asyncio.gather(*(one(b) for b in bodies))
    spent = time.process_time() - cpu
    print(f"<!-- {statistics.mean(sizes):.0f} tokens per prompt on average -->")
    return latencies, spent


async def completions(
    client: httpx.AsyncClient,
    counter: EngineCounter | None,
    backend: Backend,
    model: str,
    bodies: list[dict[str, Any]],
) -> None:
    for body in bodies:
        if counter is not None:
            payload = counter.request_body(model, body)
            assert payload is not None
            await counter.ask(backend, payload)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        answer = await client.post(path, json={**body, "model": model, "max_tokens": 1})
        assert answer.status_code == 200, answer.text


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(url: str, pid: int, model: str, requests: int, chars: int, at_once: int) -> None:
    backend = Backend.from_settings(BackendSettings(url=url))
    pool = UpstreamPool([backend])
    await pool.start()
    counter = EngineCounter(pool)
    bodies = prompts(requests, chars)
    try:
        await counts(counter, backend, model, bodies[:20], 1)  # connections, warm caches
        for label, parallel in (("one at a time", 1), (f"{at_once} at once", at_once)):
            latencies, cpu = await counts(counter, backend, model, bodies, parallel)
            print(
                f"| /tokenize, {label} | {pct(latencies, 0.5):.2f} ms | {pct(latencies, 0.99):.2f}"
                f" ms | {cpu / len(bodies) * 1e6:.0f} µs |"
            )
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await completions(client, None, backend, model, bodies[:10])
            spent: dict[str, tuple[float, float, float]] = {}
            for label, asking in (("without", None), ("with", counter)):
                server, core = cpu_seconds(pid)
                started = time.perf_counter()
                await completions(client, asking, backend, model, bodies)
                server_after, core_after = cpu_seconds(pid)
                took = time.perf_counter() - started
                spent[label] = (server_after - server, core_after - core, took)
        n = len(bodies)
        print(f"\nengine CPU for {n} completions (max_tokens 1), ms per request:")
        print("| | API server | engine core | wall time |\n| --- | --- | --- | --- |")
        for label, (server, core, took) in spent.items():
            print(
                f"| {label} /tokenize | {server / n * 1e3:.2f} | {core / n * 1e3:.2f} |"
                f" {took / n * 1e3:.2f} |"
            )
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running engine (default: start a `kvgate sim`)")
    parser.add_argument("--pid", type=int, help="the engine's process id (with --url)")
    parser.add_argument("--model", default=None, help="the served model (default: its first)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--chars", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    process = None
    url, pid = args.url, args.pid
    if url is None:
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "sim", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url, pid = f"http://127.0.0.1:{port}", process.pid
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = httpx.get(url + "/v1/models", timeout=2).json()
                break
            except (httpx.TransportError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        model = args.model or models["data"][0]["id"]
        assert pid is not None, "--pid is needed with --url"
        print(f"# {url} ({model}), {args.requests} prompts of {args.chars} characters")
        print("| what | p50 | p99 | kvgate CPU per count |\n| --- | --- | --- | --- |")
        # uvloop, the loop `kvgate serve` runs on.
        uvloop.run(run(url, pid, model, args.requests, args.chars, args.concurrency))
    finally:
        if process is not None:
            process.terminate()
            process.wait(10)


if __name__ == "__main__":
    main()
