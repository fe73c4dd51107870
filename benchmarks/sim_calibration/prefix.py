"""Prefix caching, the model against the real vLLM CPU engine: vLLM's own benchmark
client with its `prefix_repetition` dataset, once on the real engine (prefix caching on),
and the same shape of burst on one `cpu-tiny` engine model with prefix caching, in
virtual time (exactly the same token counts: the model's prompts are token ids).

    flock /work/wt/engine.lock python benchmarks/sim_calibration/prefix.py

Compared: the hit rate (`prefix_cache_hits / prefix_cache_queries` over the burst), the
burst's duration, preemptions. Prints one markdown table (results.md's section).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm_burst"))

from run import (  # type: ignore[import-not-found]  # noqa: E402
    CLIENT,
    TOKENIZER,
    VLLM_PYTHON,
    metrics,
    start_engine,
    stop,
    wait_ready,
)

from kvgate.sim.prefix_workloads import PrefixMix, prefix_mix  # noqa: E402
from kvgate.sim.presets import CPU_TINY  # noqa: E402
from kvgate.sim.runs import ClientModel, VirtualConfig  # noqa: E402
from kvgate.sim.virtual import VirtualCluster  # noqa: E402
from kvgate.sim.workload import WorkloadSpec  # noqa: E402
from kvgate.testing import free_port  # noqa: E402


def client(target: str, a: argparse.Namespace, out: Path) -> list[str]:
    return [
        str(VLLM_PYTHON), "-c", CLIENT, "--backend", "openai", "--base-url", target,
        "--endpoint", "/v1/completions", "--model", "tiny-llama", "--tokenizer", str(TOKENIZER),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(a.prefix), "--prefix-repetition-suffix-len",
        str(a.suffix), "--prefix-repetition-num-prefixes", str(a.prefixes),
        "--prefix-repetition-output-len", str(a.output), "--num-prompts", str(a.prompts),
        "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip


async def real(a: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "engine.log"
    os.environ["EXTRA"] = "--enforce-eager --enable-prefix-caching"
    engine = start_engine(port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, "/health", 180.0)
        before = await metrics(url)
        out = log.parent / "result.json"
        command = client(url, a, out)
        await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
        after = await metrics(url)
        page = await _page(url)
    finally:
        stop(engine)
    result = json.loads(out.read_text())
    hits = _counter(page, "vllm:prefix_cache_hits_total")
    queries = _counter(page, "vllm:prefix_cache_queries_total")
    return {
        "duration_s": result["duration"],
        "completed": result["completed"],
        "hit_rate": hits / queries if queries else 0.0,
        "preemptions": after.get("preemptions", 0.0) - before.get("preemptions", 0.0),
        "mean_prompt_tokens": result["total_input_tokens"] / result["completed"],
    }


async def _page(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=5.0) as http:
        return (await http.get(f"{url}/metrics")).text


def _counter(page: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{"))  # fmt: skip


def model(a: argparse.Namespace) -> dict[str, float]:
    engine = dataclasses.replace(CPU_TINY, enable_prefix_caching=True)
    mix = PrefixMix(rate_rps=1e9, prefixes=a.prefixes, prefix_tokens=a.prefix,
                    suffix_tokens=a.suffix, output_tokens=a.output)  # fmt: skip
    drawn = zip(range(a.prompts), prefix_mix(mix, 1.0, 0), strict=False)
    arrivals = [dataclasses.replace(r, arrival=0.0, stream=True) for _, r in drawn]
    config = VirtualConfig(engine=engine, workload=WorkloadSpec(), duration_s=600.0, nodes=1,
                           policy="none", client=ClientModel(timeout_s=600.0))  # fmt: skip
    result = VirtualCluster(config, arrivals).run()
    ok = [o for o in result.outcomes if o.status == "ok"]
    totals = result.engine_totals
    return {
        "duration_s": max(o.completed_at or 0.0 for o in ok),
        "completed": len(ok),
        "hit_rate": totals["prefix_cache_hits"] / totals["prefix_cache_queries"],
        "preemptions": totals["preemptions"],
        "mean_prompt_tokens": sum(o.prompt_tokens for o in ok) / len(ok),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix", type=int, default=1000)
    p.add_argument("--suffix", type=int, default=100)
    p.add_argument("--output", type=int, default=150)
    p.add_argument("--model-only", action="store_true")
    a = p.parse_args()
    rows = {"cpu-tiny model": model(a)}
    if not a.model_only:
        rows = {"real vLLM CPU": asyncio.run(real(a)), **rows}
    print(json.dumps(rows, indent=1))
    print("| engine | duration | completed | prefix hit rate | preemptions | mean prompt |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['duration_s']:.2f} s | {r['completed']:.0f} | {r['hit_rate']:.1%} "
              f"| {r['preemptions']:.0f} | {r['mean_prompt_tokens']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
