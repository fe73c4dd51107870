"""vLLM's own serving benchmark client, straight to the real vLLM CPU engine and through kvgate.

A client that does not retry sends a burst (the `random` dataset, request rate inf,
`ignore_eos`) once straight to the engine and once through `kvgate serve` with its
defaults, alternating, `--runs` times each. Every run records what the client measured
(`vllm.benchmarks.serve`'s own JSON: completed, duration, TTFT, end-to-end latency) and
what the engine saw (its preemption counter before and after, and, polled every 50 ms, its
peak KV usage and peak running/waiting counts).

    python benchmarks/vllm_burst/run.py --prompts 32 --input 500 --output 500 --runs 2
    python benchmarks/vllm_burst/run.py --prompts 32 --prefixes 2 --input 1100 --output 250
    python benchmarks/vllm_burst/run.py --prompts 16 --input 500 --output 1000 --runs 20 \
        --modes kvgate   # through kvgate only: its preemptions, run after run

The real engine is installed by scripts/install-real-vllm.sh and started here with
scripts/real-vllm/serve.sh (or give `--engine-url` for one already running). The `vllm`
console script of the CPU build does not start, so the client runs as the
`vllm.benchmarks.serve` module through a three-line entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvgate.procs import children
from kvgate.testing import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ROOT = Path(
    os.environ.get("KVGATE_VLLM_ROOT")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate-vllm"
)
VLLM_PYTHON = ROOT / "venv" / "bin" / "python"
TOKENIZER = ROOT / "tiny-llama"
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
WANTED = {
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:request_success_total": "requests",
}


def read_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = WANTED.get(name)
        if key is not None:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def metrics(engine: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(engine + "/metrics")
        return read_metrics(response.text)


async def watch(engine: str, stop: asyncio.Event) -> dict[str, float]:
    """Peak KV usage, running and waiting while the run lasts (polled every 50 ms)."""
    peak = {"kv": 0.0, "running": 0.0, "waiting": 0.0}
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            try:
                page = read_metrics((await client.get(engine + "/metrics")).text)
            except httpx.HTTPError:
                page = {}
            for key in peak:
                peak[key] = max(peak[key], page.get(key, 0.0))
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass
    return peak


async def watch_gateway(gateway: str, stop: asyncio.Event) -> dict[str, Any]:
    """What kvgate's ceiling did while the run lasted (`/admin/state` every 0.5 s): the
    lowest and highest planned-KV ceiling for standard work over its nodes, the share of
    polls that showed each of its reasons (`docs/flow-control.md`), and the highest share
    of the engine's time its meter put on recomputing preempted requests."""
    ceilings: list[float] = []
    shares: list[float] = []
    reasons: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            try:
                nodes = (await client.get(gateway + "/admin/state")).json()["policy"]["nodes"]
            except (httpx.HTTPError, ValueError, KeyError):
                nodes = {}
            for node in nodes.values():
                if isinstance(node.get("ceiling"), int | float):
                    ceilings.append(float(node["ceiling"]))
                    reason = str(node.get("ceiling_reason"))
                    reasons[reason] = reasons.get(reason, 0) + 1
                share = (node.get("measured") or {}).get("recompute_share")
                if isinstance(share, int | float):
                    shares.append(float(share))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    polls = sum(reasons.values()) or 1
    return {
        "ceiling_min": min(ceilings, default=None),
        "ceiling_max": max(ceilings, default=None),
        "ceiling_reasons": {k: round(v / polls, 2) for k, v in sorted(reasons.items())},
        "recompute_share_max": max(shares, default=None),
    }


def client_command(target: str, args: argparse.Namespace, out_dir: Path, name: str) -> list[str]:
    return [
        str(VLLM_PYTHON),
        "-c",
        CLIENT,
        "--backend",
        "openai",
        "--base-url",
        target,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny-llama",
        "--tokenizer",
        str(TOKENIZER),
        *dataset(args),
        *(["--header", *args.header] if getattr(args, "header", None) else []),
        "--num-prompts",
        str(args.prompts),
        "--request-rate",
        str(getattr(args, "rate", "inf")),
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{name}.json",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
    ]


def dataset(args: argparse.Namespace) -> list[str]:
    """The client's dataset: `random` (`--input`/`--output` tokens), or `prefix_repetition`
    with `--prefixes` shared prefixes of `--input` tokens, each prompt's own suffix of
    `--suffix` tokens and `--output` tokens out."""
    if getattr(args, "prefixes", 0):
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.input),
            "--prefix-repetition-suffix-len", str(args.suffix),
            "--prefix-repetition-num-prefixes", str(args.prefixes),
            "--prefix-repetition-output-len", str(args.output),
        ]  # fmt: skip
    return [
        "--dataset-name", "random",
        "--random-input-len", str(args.input),
        "--random-output-len", str(args.output),
        "--random-range-ratio", str(args.range_ratio),
    ]  # fmt: skip


async def one_run(
    mode: str, target: str, engine: str, args: argparse.Namespace, out_dir: Path, i: int
) -> dict[str, Any]:
    name = f"{mode}-{i}"
    before = await metrics(engine)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(engine, stop))
    ceiling = asyncio.create_task(watch_gateway(target, stop)) if mode == "kvgate" else None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *client_command(target, args, out_dir, name),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    output, _ = await proc.communicate()
    wall = time.monotonic() - started
    stop.set()
    peak = await watcher
    kvgate = {} if ceiling is None else await ceiling
    await asyncio.sleep(1.0)  # the last preemptions are counted when victims run again
    after = await metrics(engine)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark client failed:\n{output.decode()[-3000:]}")
    result = json.loads((out_dir / f"{name}.json").read_text())
    errors = [e for e in result.get("errors", []) if e]
    return {
        "mode": mode,
        "run": i,
        "completed": result["completed"],
        "failed": result.get("failed", args.prompts - result["completed"]),
        "first_error": errors[0][:200] if errors else None,
        "duration_s": result["duration"],
        "client_wall_s": wall,
        "output_tok_s": result["output_throughput"],
        "mean_ttft_s": result["mean_ttft_ms"] / 1000,
        "p99_ttft_s": result["p99_ttft_ms"] / 1000,
        "mean_e2el_s": result["mean_e2el_ms"] / 1000,
        "p99_e2el_s": result["p99_e2el_ms"] / 1000,
        "preemptions": after.get("preemptions", 0.0) - before.get("preemptions", 0.0),
        "peak_kv": peak["kv"],
        "peak_running": peak["running"],
        "peak_waiting": peak["waiting"],
        **kvgate,
    }


def start_engine(
    port: int, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """scripts/real-vllm/serve.sh on `port`, with `env` (serve.sh's knobs: EXTRA,
    ENGINE_CPUS, ...) over this process's environment."""
    return subprocess.Popen(
        ["bash", str(REPO / "scripts" / "real-vllm" / "serve.sh"), str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def start_gateway(engine: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvgate", "serve", "--backend", engine, "--port", str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


async def wait_ready(url: str, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url + path)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f} s")


async def wait_idle(engine: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = await metrics(engine)
        if page.get("running", 0) == 0 and page.get("waiting", 0) == 0:
            return
        await asyncio.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    children.stop(proc, 20.0, group=True)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="vllm-burst-"))
    engine_proc = None
    engine = args.engine_url
    if engine is None:
        port = free_port()
        engine = f"http://127.0.0.1:{port}"
        if args.prefixes:
            os.environ["EXTRA"] = "--enforce-eager --enable-prefix-caching"
        engine_proc = start_engine(port, work / "engine.log")
    gw_port = free_port()
    gateway_url = f"http://127.0.0.1:{gw_port}"
    gateway = None
    rows: list[dict[str, Any]] = []
    try:
        await wait_ready(engine, "/health", 600)
        gateway = start_gateway(engine, gw_port, work / "gateway.log")
        await wait_ready(gateway_url, "/readyz", 60)
        for i in range(1, args.runs + 1):
            targets = {"direct": engine, "kvgate": gateway_url}
            for mode in args.modes.split(","):
                target = targets[mode]
                await wait_idle(engine)
                row = await one_run(mode, target, engine, args, work, i)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if gateway is not None:
            stop(gateway)
        if engine_proc is not None:
            stop(engine_proc)
    print(f"logs and client JSON in {work}", file=sys.stderr)
    return rows


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input", type=int, default=500)
    parser.add_argument("--output", type=int, default=500)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument(
        "--prefixes",
        type=int,
        default=0,
        help="vLLM's prefix_repetition dataset with this many shared prefixes of --input"
        " tokens (the engine then runs with --enable-prefix-caching)",
    )
    parser.add_argument("--suffix", type=int, default=100, help="with --prefixes")
    parser.add_argument(
        "--header", nargs="*", help="KEY=VALUE headers of every request (e.g. a priority)"
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--modes", default="direct,kvgate", help="which of direct,kvgate to run, in this order"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-url", help="an engine already running (not stopped)")
    parser.add_argument("--json", type=Path, help="append the rows to this JSON file")
    return parser.parse_args()


if __name__ == "__main__":
    options = parse()
    results = asyncio.run(main(options))
    if options.json is not None:
        previous = json.loads(options.json.read_text()) if options.json.exists() else []
        options.json.write_text(json.dumps(previous + results, indent=2) + "\n")
