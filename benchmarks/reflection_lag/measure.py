"""When does a real vLLM's KV gauge contain a request, relative to its first token?

The admission core credits a sample with a request's prompt only if the sample was taken
at least `reflect_margin_s` after the request's first token reached the gateway (see
`kvgate.core.plan.holds`). This measures, on the real vLLM CPU engine, the time from
the first streamed token to the first `/metrics` poll (stamped when the poll was *sent*)
whose `vllm:kv_cache_usage_perc` contains the prompt. A positive lag is what the margin
must cover; a negative one means the gauge already showed the prompt before the token.

    python benchmarks/reflection_lag/measure.py [--trials 8]

Holds the machine-wide real-engine lock, starts `serve.sh` on a free port, stops it after.
Writes results.md next to this file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from kvgate.bench.driver import REAL_VLLM_LOCK, REAL_VLLM_SERVE, real_vllm_lock
from kvgate.procs.ports import free_port

CAPACITY = 4096  # serve.sh defaults: 128 blocks x 32 tokens
PROMPT = 1000
BLOCK = 32


async def _kv_usage(session: aiohttp.ClientSession, base: str) -> float:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("no vllm:kv_cache_usage_perc on the page")


async def _wait_healthy(base: str, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            try:
                async with session.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1.0)
    raise RuntimeError("the engine did not become healthy in time")


async def _trial(base: str, seed: int) -> tuple[float, float | None, float]:
    """Seconds: (first poll showing the prompt - first token, latest poll sent after the
    first token (and before the last poll showing the prompt) that did NOT show it - first
    token, or None, median poll period)."""
    prompt = [(seed * 7919 + i * 31) % 8000 + 100 for i in range(PROMPT)]
    threshold = (PROMPT // BLOCK) * BLOCK / CAPACITY
    polls: list[tuple[float, float]] = []
    first_token: list[float] = []
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:

        async def poll() -> None:
            while not done.is_set():
                sent = time.monotonic()
                polls.append((sent, await _kv_usage(session, base)))
                await asyncio.sleep(0.002)

        async def request() -> None:
            body = {
                "model": "tiny-llama",
                "prompt": prompt,
                "max_tokens": 200,
                "stream": True,
                "ignore_eos": True,
            }
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                async for _chunk in resp.content.iter_any():
                    if not first_token:
                        first_token.append(time.monotonic())
            done.set()

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.1)
        await asyncio.wait_for(request(), timeout=120)
        await poller
    seen = next((sent for sent, usage in polls if usage >= threshold), None)
    if seen is None or not first_token:
        raise RuntimeError("the gauge never showed the prompt")
    period = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(polls))
    # Upper end of the window: the last poll that still showed the prompt. Under load the
    # client may read the final chunks long after the engine freed the request, so the
    # last token's arrival would count polls taken after the request had ended.
    ft = first_token[0]
    end = max(sent for sent, usage in polls if usage >= threshold)
    missed = [sent - ft for sent, usage in polls if ft <= sent < end and usage < threshold]
    return seen - ft, (max(missed) if missed else None), period


async def _measure(base: str, trials: int) -> list[tuple[float, float | None, float]]:
    await _wait_healthy(base, 420)
    await _trial(base, 0)  # warm-up
    results = []
    for i in range(trials):
        results.append(await _trial(base, i + 1))
        await asyncio.sleep(0.5)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = Path("/tmp") / f"reflection-lag-vllm-{port}.log"
    with real_vllm_lock(), open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(REAL_VLLM_SERVE), str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            results = asyncio.run(_measure(base, args.trials))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    lags = [lag for lag, _, _ in results]
    missed = [m for _, m, _ in results]
    periods = [p for _, _, p in results]
    rows = "\n".join(
        f"| {i + 1} | {lag * 1000:+.1f} | {'-' if m is None else f'{m * 1000:.1f}'} |"
        for i, (lag, m, _) in enumerate(results)
    )
    worst = max((m for m in missed if m is not None), default=None)
    text = (
        "# KV gauge lag after the first token (real vLLM CPU engine)\n\n"
        f"Command: `python benchmarks/reflection_lag/measure.py --trials {args.trials}`;"
        f" prompt {PROMPT} token ids, streaming, `/metrics` polled back to back (median poll"
        f" period {statistics.median(periods) * 1000:.1f} ms), polls stamped when sent."
        f" Machine: {platform.machine()}, shared 2-core box under load from other jobs;"
        f" lock {REAL_VLLM_LOCK}.\n\n"
        "`first showing`: (send time of the first poll whose KV usage contains the prompt) -"
        " (arrival of the first streamed chunk); negative: the gauge showed the prompt before"
        " the token reached the client; positive values up to one poll period are just the"
        " polling grid. `missed`: the latest poll sent after the first token (and before the"
        " last poll that showed the prompt: a running request's KV only grows) whose KV usage"
        " did NOT contain the prompt, i.e. the margin the core needs; `-`: none.\n\n"
        "| trial | first showing (ms) | missed (ms) |\n"
        "| --- | --- | --- |\n"
        f"{rows}\n\nfirst showing: max {max(lags) * 1000:+.1f} ms, median"
        f" {statistics.median(lags) * 1000:+.1f} ms; missed: worst"
        f" {'none' if worst is None else f'{worst * 1000:.1f} ms'};"
        " `reflect_margin_s` defaults to 100 ms.\n"
    )
    out_path = Path(__file__).with_name("results.md")
    out_path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
