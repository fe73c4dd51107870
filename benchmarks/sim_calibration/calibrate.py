"""Run the same workloads against the real vLLM CPU engine and against `kvgate sim`.

    python benchmarks/sim_calibration/calibrate.py --real http://127.0.0.1:PORT \
        --sim http://127.0.0.1:PORT2 --out benchmarks/sim_calibration/results.json

Each workload sends N concurrent streaming completions (prompts as token ids, so both
engines see exactly the same prompt length; `ignore_eos`), records each request's time to
first token and token count, and polls `/metrics` every 100 ms for KV usage, running and
waiting. Throughput is output tokens over the wall time of the whole batch; preemptions
are the delta of `vllm:num_preemptions_total` (vLLM's lazy count, on both sides).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

WORKLOADS: dict[str, dict[str, int]] = {
    "single stream (100 in, 500 out)": {"n": 1, "prompt": 100, "max_tokens": 500},
    "light: 4 streams (200 in, 200 out)": {"n": 4, "prompt": 200, "max_tokens": 200},
    "32 streams (16 in, 80 out; fits the KV)": {"n": 32, "prompt": 16, "max_tokens": 80},
    "32 streams (50 in, 300 out; overflows the KV)": {"n": 32, "prompt": 50, "max_tokens": 300},
    "overload: 16 x (500 in, 1000 out)": {"n": 16, "prompt": 500, "max_tokens": 1000},
}


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    text = (await http.get("/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:num_preemptions_total",
                "vllm:generation_tokens_total",
            ):
                out[s.name] = s.value
    return out


async def one(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    start = time.perf_counter()
    ttft, chunks, tokens = None, 0, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("choices") and payload["choices"][0].get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - start
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    return {"ttft": ttft, "chunks": chunks, "tokens": tokens or chunks,
            "e2e": time.perf_counter() - start}  # fmt: skip


async def workload(base: str, name: str, n: int, prompt: int, max_tokens: int) -> dict[str, Any]:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        before = await scrape(http)
        samples: list[dict[str, float]] = []
        done = asyncio.Event()

        async def poll() -> None:
            while not done.is_set():
                samples.append(await scrape(http))
                await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll())
        start = time.perf_counter()
        prompts = [[rng.randrange(10, 8000) for _ in range(prompt)] for _ in range(n)]
        results = await asyncio.gather(*(one(http, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - start
        done.set()
        await poller
        after = await scrape(http)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in results)
    return {
        "workload": name,
        "requests": n,
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "ttft_median_s": ttfts[len(ttfts) // 2],
        "ttft_max_s": ttfts[-1],
        "per_stream_tok_s": sum(r["tokens"] / r["e2e"] for r in results) / n,
        "preemptions": after.get("vllm:num_preemptions_total", 0)
        - before.get("vllm:num_preemptions_total", 0),
        "kv_usage_max": max((s.get("vllm:kv_cache_usage_perc", 0) for s in samples), default=0),
        "running_max": max((s.get("vllm:num_requests_running", 0) for s in samples), default=0),
        "waiting_max": max((s.get("vllm:num_requests_waiting", 0) for s in samples), default=0),
    }


async def collect(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    report: dict[str, list[dict[str, Any]]] = {}
    for label, base in (("real", args.real), ("sim", args.sim)):
        if not base:
            continue
        rows = []
        for name, w in WORKLOADS.items():
            for _ in range(args.repeat):
                row = await workload(base, name, w["n"], w["prompt"], w["max_tokens"])
                print(label, json.dumps(row), flush=True)
                rows.append(row)
                await asyncio.sleep(1.0)
        report[label] = rows
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--real", help="base URL of the real vLLM engine")
    parser.add_argument("--sim", help="base URL of the simulated engine")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    report = asyncio.run(collect(args))
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
