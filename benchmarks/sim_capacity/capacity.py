"""How many concurrent streams can one simulated engine serve in real time on one core?

    python benchmarks/sim_capacity/capacity.py --streams 100 200 300 400 --seconds 10

For each stream count, starts `kvgate sim --preset gpu-8b --num-blocks 200000` (1,024
sequences; KV raised to 3.2M tokens so that it never fills and nothing is preempted; one
process, one thread, so at most one core) and a
load generator in this process (`--pin`: server on CPU 0, client on CPU 1),
opens N streaming completions (prompt 200 token ids, `max_tokens` 3000, `ignore_eos`),
waits until every stream has its first token, then measures for `--seconds`:

- the simulator's own lateness: `sim:step_lag_seconds_total` / `sim:busy_seconds_total`
  (0 % = every step ended when the model said; 10 % = steps ran 10 % long because the
  process was busy serving HTTP),
- the server's CPU use (from /proc), delivered tokens/s and the mean client-seen
  inter-token gap against the model's step time.

A count "keeps up" when lateness stays under 10 %. On a shared, busy machine lateness
mostly measures the other processes; the server's CPU time per delivered token does not,
so the table also gives the share of one core needed to serve every stream at the model's
pace (under 100 %: one core suffices). Results go to results.md next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


async def stream(session: aiohttp.ClientSession, base: str, stats: dict, stop: asyncio.Event):
    body = {"prompt": list(range(200)), "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with session.post(base + "/v1/completions", json=body) as response:
        stats["started"] += 1
        last = None
        async for line in response.content:
            if stop.is_set():
                break
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is None:
                stats["streaming"] += 1
            if stats["measuring"]:
                stats["tokens"] += 1
                if last is not None:
                    stats["gap_sum"] += now - last
                    stats["gaps"] += 1
            last = now


async def measure(base: str, n: int, seconds: float, pid: int) -> dict[str, float]:
    stats = {"started": 0, "streaming": 0, "tokens": 0, "gap_sum": 0.0, "gaps": 0,
             "measuring": False}  # fmt: skip
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(stream(session, base, stats, stop)) for _ in range(n)]
        for _ in range(1200):  # until every stream has its first token (prefills done)
            if stats["streaming"] >= n:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        lag0 = await metric(session, base, "sim:step_lag_seconds_total")
        busy0 = await metric(session, base, "sim:busy_seconds_total")
        steps0 = await metric(session, base, "vllm:inter_token_latency_seconds_count")
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        stats["measuring"] = True
        await asyncio.sleep(seconds)
        stats["measuring"] = False
        wall = time.perf_counter() - t0
        cpu1 = cpu_seconds(pid)
        lag1 = await metric(session, base, "sim:step_lag_seconds_total")
        busy1 = await metric(session, base, "sim:busy_seconds_total")
        steps1 = await metric(session, base, "vllm:inter_token_latency_seconds_count")
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    busy = busy1 - busy0
    decode_steps = (steps1 - steps0) / n
    step_s = busy / decode_steps if decode_steps else float("nan")
    cpu_per_token = (cpu1 - cpu0) / max(1, stats["tokens"])
    return {
        "streams": n,
        "started": stats["started"],
        "lateness_pct": 100.0 * (lag1 - lag0) / busy if busy else float("nan"),
        "server_cpu_pct": 100.0 * (cpu1 - cpu0) / wall,
        "tokens_per_s": stats["tokens"] / wall,
        "client_gap_ms": 1000.0 * stats["gap_sum"] / max(1, stats["gaps"]),
        "model_step_ms": 1000.0 * step_s,
        "cpu_us_per_token": 1e6 * cpu_per_token,
        # Share of one core needed to deliver every stream's tokens at the model's pace.
        "core_needed_pct": 100.0 * (n / step_s) * cpu_per_token,
        "load": os.getloadavg()[0],
    }


def run_one(n: int, seconds: float, pin: bool) -> dict[str, float]:
    port = free_port()
    # 200k blocks (3.2M tokens): KV never fills, so no preemption muddles the measurement.
    command = [sys.executable, "-m", "kvgate", "sim", "--preset", "gpu-8b", "--port", str(port),
               "--num-blocks", "200000"]  # fmt: skip
    if pin:
        command = ["taskset", "-c", "0", *command]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()  # "engine 0: http://..." once it listens
        if pin:
            os.sched_setaffinity(0, {1})
        return asyncio.run(measure(f"http://127.0.0.1:{port}", n, seconds, server.pid))
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 200, 300, 400])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--pin", action="store_true", help="server on CPU 0, client on CPU 1")
    parser.add_argument("--out", default=str(HERE / "results.md"))
    args = parser.parse_args()
    rows = []
    for n in args.streams:
        row = run_one(n, args.seconds, args.pin)
        print(row, flush=True)
        rows.append(row)
    lines = [
        "| streams | lateness vs model | server CPU | tokens/s delivered | client gap | "
        "model step | server CPU per token | core needed at model pace | load avg |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['lateness_pct']:.1f} % | {r['server_cpu_pct']:.0f} % | "
            f"{r['tokens_per_s']:.0f} | {r['client_gap_ms']:.1f} ms | "
            f"{r['model_step_ms']:.1f} ms | {r['cpu_us_per_token']:.0f} us | "
            f"{r['core_needed_pct']:.0f} % | {r['load']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    Path(args.out + ".table").write_text(table + "\n")


if __name__ == "__main__":
    main()
