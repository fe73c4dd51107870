"""Two tenants, live: a flood of looping clients and a light tenant that does not retry.

Real processes on loopback: one simulated vLLM engine (`kvgate sim`, cpu-tiny), `kvgate
serve` with two API keys (tenants `flood` and `light`) and its defaults, and a load
generator here. Both tenants send the same request shape (a ~200-token prompt, 200 output
tokens, ignore_eos, streamed):

- `flood`: 30 clients in a loop, each sending its next request as soon as the last ends,
  waiting the Retry-After of a 429 before trying again;
- `light`: one request every 2 s, never retried.

Phases: the flood alone (its throughput is the capacity), then flood and light together.
Reports the light tenant's share served and its TTFT against the duration of one request
on the idle engine, and the flood's throughput with and without the light tenant.

    python benchmarks/tenant_fairness/run.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

import httpx

from kvgate.procs import children
from kvgate.testing import free_port

HERE = Path(__file__).resolve().parent
KEYS = {"flood": "flood-key-0123456789", "light": "light-key-0123456789"}
PROMPT = "word " * 200
MAX_TOKENS = 200


@dataclass
class Tally:
    sent: int = 0
    served: int = 0
    refused: int = 0
    ttfts: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    tokens: int = 0


async def one(client: httpx.AsyncClient, url: str, tenant: str, tally: Tally) -> float | None:
    """Send one request; returns the Retry-After of a 429, else None."""
    body = {
        "model": "sim-llama",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    tally.sent += 1
    started = time.monotonic()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            tally.refused += 1
            return float(response.headers.get("retry-after", "1"))
        async for line in response.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                if first is None:
                    first = time.monotonic()
                tokens += 1
    tally.served += 1
    tally.tokens += tokens
    tally.ttfts.append((first or time.monotonic()) - started)
    tally.durations.append(time.monotonic() - started)
    return None


async def flood_client(client: httpx.AsyncClient, url: str, tally: Tally, until: float) -> None:
    while time.monotonic() < until:
        retry = await one(client, url, "flood", tally)
        if retry is not None:
            await asyncio.sleep(min(retry, max(0.0, until - time.monotonic())))


async def light_client(client: httpx.AsyncClient, url: str, tally: Tally, until: float) -> None:
    tasks = []
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(one(client, url, "light", tally)))
        await asyncio.sleep(2.0)
    await asyncio.gather(*tasks)


async def phase(url: str, seconds: float, light: bool) -> tuple[Tally, Tally, float]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=300.0, limits=limits) as client:
        flood, light_tally = Tally(), Tally()
        started = time.monotonic()
        until = started + seconds
        jobs = [flood_client(client, url, flood, until) for _ in range(30)]
        if light:
            jobs.append(light_client(client, url, light_tally, until))
        await asyncio.gather(*jobs)
        return flood, light_tally, time.monotonic() - started


async def idle_duration(url: str) -> float:
    async with httpx.AsyncClient(timeout=60.0) as client:
        tally = Tally()
        for _ in range(3):
            await one(client, url, "light", tally)
        return mean(tally.durations)


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    children.stop(proc, 20.0, group=True)


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient(timeout=2.0) as client:
        for _ in range(120):
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(url)


async def main(seconds: float) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="tenant-fairness-"))
    engine_port, gateway_port = free_port(), free_port()
    config = work / "kvgate.yaml"
    config.write_text(
        json.dumps(
            {
                "backends": [f"http://127.0.0.1:{engine_port}"],
                "server": {"listen": f"127.0.0.1:{gateway_port}"},
                "auth": {"keys": [{"key": k, "tenant": t} for t, k in KEYS.items()]},
            }
        )
    )
    kvgate = [sys.executable, "-m", "kvgate"]
    engine = start([*kvgate, "sim", "--port", str(engine_port)], work / "sim.log")
    gateway = None
    try:
        await wait_ready(f"http://127.0.0.1:{engine_port}/health")
        gateway = start([*kvgate, "serve", "--config", str(config)], work / "serve.log")
        base = f"http://127.0.0.1:{gateway_port}"
        await wait_ready(base + "/readyz")
        url = base + "/v1/completions"
        duration = await idle_duration(url)
        flood_alone, _, alone_s = await phase(url, seconds, light=False)
        flood, light, both_s = await phase(url, seconds, light=True)
    finally:
        if gateway is not None:
            stop(gateway)
        stop(engine)
    ttfts = sorted(light.ttfts)
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
    return {
        "idle_request_s": duration,
        "flood_alone_tok_s": flood_alone.tokens / alone_s,
        "flood_with_light_tok_s": flood.tokens / both_s,
        "both_tok_s": (flood.tokens + light.tokens) / both_s,
        "light_sent": light.sent,
        "light_served": light.served,
        "light_refused": light.refused,
        "light_ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else float("nan"),
        "light_ttft_p90_s": p90,
        "light_ttft_max_s": ttfts[-1] if ttfts else float("nan"),
        "flood_served": flood.served,
        "flood_refused": flood.refused,
        "logs": str(work),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    result = asyncio.run(main(parser.parse_args().seconds))
    print(json.dumps(result, indent=2))
