"""How many concurrent streams can one simulated engine serve in real time on one core?

    python benchmarks/sim_capacity/capacity.py --streams 100 200 300 400 --seconds 10

For each stream count, starts `kvgate sim --preset gpu-8b --num-blocks 200000` (1,024
sequences; KV raised to 3.2M tokens so that it never fills and nothing is preempted; one
process, one thread, so at most one core) and a
load generator in this process (`--pin`: server on CPU 0, client on CPU 1),
opens N streaming completions (prompt 200 token ids, `max_tokens` 3000, `ignore_eos`),
waits until every stream has its first token, then measures for `--seconds`:

- the engine's pace: model seconds stepped per wall second (`sim:busy_seconds_total`
  against the clock, from one page fetch before and one after). Every stream is busy, so
  the engine never idles: 100 % is real time, 80 % means its steps took 25 % longer than
  the model says because the process could not keep up;
- how late steps ended against the model's timeline, on average, as a share of a step
  (`sim:step_lag_seconds_total` / `sim:busy_seconds_total`: timer and scheduling jitter
  when the pace is kept, a growing backlog when it is not);
- the server's CPU use (from /proc), delivered tokens/s and the mean client-seen
  inter-token gap against the model's step time.

A count "keeps up" when the pace stays at or above 95 %. On a shared, busy machine the
pace also measures the other processes (`--nice -10` gives the server priority); the
server's CPU time per delivered token does not, so the table also gives the share of one
core needed to serve every stream at the model's pace. Results go to results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.testing import free_port

HERE = Path(__file__).resolve().parent
LAG, BUSY = "sim:step_lag_seconds_total", "sim:busy_seconds_total"
STEPS = "vllm:inter_token_latency_seconds_count"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def sample(session: aiohttp.ClientSession, base: str, names: list[str]) -> dict[str, float]:
    """The named series from ONE fetch of the page, stamped at the fetch's midpoint (a busy
    server answers slowly, and separate fetches would each cover a different window)."""
    sent = time.perf_counter()
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out = {"at": (sent + time.perf_counter()) / 2}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[s.name] = s.value
    missing = set(names) - set(out)
    if missing:
        raise KeyError(sorted(missing))
    return out


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
        names = [LAG, BUSY, STEPS]
        before = await sample(session, base, names)
        cpu0, t_on = cpu_seconds(pid), time.perf_counter()
        stats["measuring"] = True
        await asyncio.sleep(seconds)
        stats["measuring"] = False
        cpu1, window = cpu_seconds(pid), time.perf_counter() - t_on
        after = await sample(session, base, names)
        wall = after["at"] - before["at"]
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    busy = after[BUSY] - before[BUSY]
    decode_steps = (after[STEPS] - before[STEPS]) / n
    step_s = busy / decode_steps if decode_steps else float("nan")
    cpu_per_token = (cpu1 - cpu0) / max(1, stats["tokens"])
    return {
        "streams": n,
        "started": stats["started"],
        # Model seconds stepped per wall second, the engine never idle: 100 % = real time.
        "pace_pct": 100.0 * busy / wall,
        "lateness_pct": 100.0 * (after[LAG] - before[LAG]) / busy if busy else float("nan"),
        "server_cpu_pct": 100.0 * (cpu1 - cpu0) / window,
        "tokens_per_s": stats["tokens"] / window,
        "client_gap_ms": 1000.0 * stats["gap_sum"] / max(1, stats["gaps"]),
        "model_step_ms": 1000.0 * step_s,
        "cpu_us_per_token": 1e6 * cpu_per_token,
        # Share of one core needed to deliver every stream's tokens at the model's pace.
        "core_needed_pct": 100.0 * (n / step_s) * cpu_per_token,
        "load": os.getloadavg()[0],
    }


def run_one(n: int, seconds: float, pin: bool, nice: int = 0) -> dict[str, float]:
    port = free_port()
    # 200k blocks (3.2M tokens): KV never fills, so no preemption muddles the measurement.
    command = [sys.executable, "-m", "kvgate", "sim", "--preset", "gpu-8b", "--port", str(port),
               "--num-blocks", "200000"]  # fmt: skip
    if pin:
        command = ["taskset", "-c", "0", *command]
    if nice:
        # A higher priority than the machine's other work: on a shared box the server then
        # gets its core, and lateness measures the simulator instead of the neighbours.
        command = ["nice", "-n", str(nice), *command]
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
    parser.add_argument(
        "--nice", type=int, default=0, help="run the server at this niceness (e.g. -10, as root)"
    )
    parser.add_argument("--out", default=str(HERE / "results.md"))
    args = parser.parse_args()
    rows = []
    for n in args.streams:
        row = run_one(n, args.seconds, args.pin, args.nice)
        print(row, flush=True)
        rows.append(row)
    lines = [
        "| streams | pace | step ends late by | server CPU | tokens/s delivered | client gap | "
        "model step | server CPU per token | core needed at model pace | load avg |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['pace_pct']:.0f} % | {r['lateness_pct']:.1f} % | "
            f"{r['server_cpu_pct']:.0f} % | "
            f"{r['tokens_per_s']:.0f} | {r['client_gap_ms']:.1f} ms | "
            f"{r['model_step_ms']:.1f} ms | {r['cpu_us_per_token']:.0f} us | "
            f"{r['core_needed_pct']:.0f} % | {r['load']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    Path(args.out + ".table").write_text(table + "\n")


if __name__ == "__main__":
    main()
