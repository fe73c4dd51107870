"""Routing by prefix cache on two real vLLM CPU engines, through kvgate and without it.

Two engines (scripts/real-vllm/serve.sh: the tiny model, 4,096 KV tokens each, prefix
caching and KV events on, engine A pinned to CPU 0, B to CPU 1) serve vLLM's own
benchmark client (`vllm.benchmarks.serve`, driven as in benchmarks/vllm_burst/run.py,
whose helpers this script imports) with its `prefix_repetition` dataset: `--prefixes`
shared prefixes of `--input` tokens, each prompt's own `--suffix` tokens after it,
`--output` tokens out (ignore_eos), `--prompts` prompts sent at `--rate` (inf: all at
once). Each run starts its engines afresh (empty caches: this vLLM build serves no
`/reset_prefix_cache` without its development mode) and goes, by mode:

* `one-engine`: straight to engine A alone: the hit rate one engine reaches;
* `round-robin`: through `RoundRobinProxy` (below), each request to the next engine in
  turn, passed through untouched: what nginx in front of the engines does, and nothing of
  kvgate's (kvgate's own `round-robin` baseline would still count each prompt with the
  engine's `/tokenize`, queue and relay);
* `kvgate`: `kvgate serve` with both engines and their `kv_events` (the precise prefix
  index), its defaults otherwise;
* `kvgate-approx`: `kvgate serve` without `kv_events` (the index of its own placements).

Recorded per run: the client's figures (completed, failed, duration, output tok/s, TTFT
mean and p90, end-to-end mean), per engine its prefix cache hit rate (the deltas of
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`), preemptions,
requests served and peak KV usage, the combined hit rate, and through kvgate where the
requests went and why (its access log's `backend` and `placement`) and what its prefix
index held at the end (`/admin/state`).

    flock /work/wt/engine.lock python benchmarks/prefix_routing/real.py --modes kvgate
    python benchmarks/prefix_routing/real.py --report   # results.md's "Real engines"

`--modes` (default: all four, in that order) and `--runs` choose what one invocation
runs; under the shared engine lock, one run per invocation keeps others' wait short. Each
invocation appends its rows to real-results.json next to this file (results.json holds
the virtual benchmark's); `--report` writes the section of results.md from it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import httpx
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

from kvgate.procs.ports import free_port

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "real-results.json"
REPORT = HERE / "results.md"
#: The heading of this benchmark's section of results.md (run.py's report keeps it).
SECTION = "## Real engines"  # run.py's REAL_SECTION
MODES = ("one-engine", "round-robin", "kvgate", "kvgate-approx")
#: Headers a proxy does not pass on (RFC 9110 7.6.1), and the ones it sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def _load_burst() -> ModuleType:
    """benchmarks/vllm_burst/run.py as a module (under the name tests' loader gives it)."""
    name = "benchmark_vllm_burst_run"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE.parent / "vllm_burst" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


burst = _load_burst()


class RoundRobinProxy:
    """An HTTP reverse proxy sending each request to the next upstream in turn: method,
    path, query, body and end-to-end headers as they came, the answer streamed back as
    it arrives (no decompression, no buffering)."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        if not upstreams:
            raise ValueError("no upstream")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self._turn = itertools.cycle(self.upstreams)
        self.sent: Counter[str] = Counter()  # requests per upstream
        self._session: ClientSession | None = None
        self._runner: web.AppRunner | None = None

    def pick(self) -> str:
        upstream = next(self._turn)
        self.sent[upstream] += 1
        return upstream

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        upstream = self.pick()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self._session.request(
            request.method,
            upstream + request.rel_url.path_qs,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as answer:
            response = web.StreamResponse(
                status=answer.status,
                reason=answer.reason,
                headers={k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def start(self, port: int, host: str = "127.0.0.1") -> None:
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            timeout=ClientTimeout(total=None),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


@dataclass
class Engine:
    """One real engine: its name, the CPU it is pinned to, its HTTP port and, on the two
    ports after it, its KV event publisher and replay socket."""

    name: str
    cpus: str
    port: int = field(default_factory=lambda: free_port(3))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> str:
        """The backend's `kv_events` in kvgate's configuration."""
        return f"tcp://127.0.0.1:{self.port + 1}?replay=tcp://127.0.0.1:{self.port + 2}"

    def env(self) -> dict[str, str]:
        """serve.sh's knobs. serve.sh splits EXTRA on blanks: the JSON has none."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.port + 1}",  # a wildcard: vLLM binds (else connects)
            "replay_endpoint": f"tcp://*:{self.port + 2}",
        }
        extra = "--enforce-eager --enable-prefix-caching --kv-events-config "
        return {
            "EXTRA": extra + json.dumps(config, separators=(",", ":")),
            "ENGINE_CPUS": self.cpus,
        }

    def start(self, work: Path) -> None:
        log = work / f"engine-{self.name}-{self.port}.log"
        self.proc = cast(subprocess.Popen[bytes], burst.start_engine(self.port, log, self.env()))

    async def serve(self, work: Path, tries: int = 3, timeout_s: float = 600.0) -> None:
        """Start and wait for `/health`. A start that dies is tried again on other ports:
        `free_port` saw its three ports free, but another process (vLLM's own sockets
        take random ports) may bind one of them before the engine does."""
        for _ in range(tries):
            self.start(work)
            assert self.proc is not None
            deadline = time.monotonic() + timeout_s
            async with httpx.AsyncClient(timeout=2.0) as client:
                while self.proc.poll() is None and time.monotonic() < deadline:
                    try:
                        if (await client.get(self.url + "/health")).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.5)
            self.stop()
            self.port = free_port(3)
        raise RuntimeError(f"engine {self.name} did not start in {tries} tries (logs in {work})")

    def stop(self) -> None:
        if self.proc is not None:
            burst.stop(self.proc)
            self.proc = None


def gateway_config(engines: Sequence[Engine], kv_events: bool) -> str:
    lines = ["backends:"]
    for engine in engines:
        events = f', kv_events: "{engine.kv_events}"' if kv_events else ""
        lines.append(f'  - {{url: "{engine.url}"{events}}}')
    return "\n".join(lines) + "\n"


def start_gateway(
    engines: Sequence[Engine], kv_events: bool, port: int, work: Path
) -> subprocess.Popen[bytes]:
    config = work / f"kvgate-{port}.yaml"
    config.write_text(gateway_config(engines, kv_events))
    log = work / f"kvgate-{port}.log"
    return subprocess.Popen(
        [sys.executable, "-m", "kvgate", "serve", "--config", str(config), "--port", str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


ACCESS_LINE = re.compile(r'\{"id":')


def access_records(log_text: str) -> list[dict[str, Any]]:
    """The access lines of a gateway's log (JSON objects starting with `{"id":`)."""
    decoder = json.JSONDecoder()
    out = []
    for line in log_text.splitlines():
        match = ACCESS_LINE.search(line)
        if match is None:
            continue
        try:
            record, _ = decoder.raw_decode(line, match.start())
        except ValueError:
            continue
        if isinstance(record, dict) and "placement" in record:
            out.append(record)
    return out


def placements(records: list[dict[str, Any]], names: dict[str, str]) -> dict[str, Any]:
    """Through kvgate: completions per engine (by name); how they were placed (`cached`:
    where the index predicted part of the prompt cached, `uncached`: by prefix with nothing
    cached anywhere, `headroom`); the prompt tokens predicted cached against those sent;
    the mean time a request waited in kvgate's queue."""
    per_engine: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    cached = prompt = 0
    queued = []
    for r in records:
        if r.get("route") != "/v1/completions":
            continue
        backend = str(r.get("backend"))
        per_engine[next((n for u, n in names.items() if backend.endswith(u)), backend)] += 1
        placement = str(r.get("placement") or "none")
        if placement.startswith("prefix "):
            hit, _, total = placement.split(" ", 1)[1].partition("/")
            cached, prompt = cached + int(hit), prompt + int(total)
            routes["cached" if int(hit) else "uncached"] += 1
        else:
            routes[placement] += 1
        queued.append(float(r.get("queue_s") or 0.0))
    return {
        "requests": dict(sorted(per_engine.items())),
        "by": dict(routes),
        "predicted_cached": cached / prompt if prompt else None,
        "mean_queue_s": statistics.mean(queued) if queued else None,
    }


def prefix_state(state: Any) -> dict[str, Any]:
    """Every `prefix*` entry of each node of `/admin/state` (what kvgate's index holds)."""
    policy = state.get("policy", {}) if isinstance(state, dict) else {}
    nodes = policy.get("nodes", {}) if isinstance(policy, dict) else {}
    return {
        str(node): {k: v for k, v in fields.items() if k.startswith("prefix")}
        for node, fields in (nodes.items() if isinstance(nodes, dict) else ())
        if isinstance(fields, dict)
    }


def hit_rate(hits: float, queries: float) -> float | None:
    return hits / queries if queries else None


async def measure(
    mode: str, target: str, engines: Sequence[Engine], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    """One client run against `target`: the client's figures and each engine's deltas."""
    name = f"{mode}-{int(time.time())}"
    before = [await burst.metrics(e.url) for e in engines]
    stop = asyncio.Event()
    watchers = [asyncio.create_task(burst.watch(e.url, stop)) for e in engines]
    command = [
        *burst.client_command(target, args, work, name),
        "--metric-percentiles",
        "50,90,99",
    ]
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await proc.communicate()
    stop.set()
    peaks = [await w for w in watchers]
    await asyncio.sleep(1.0)  # the last preemptions are counted when victims run again
    after = [await burst.metrics(e.url) for e in engines]
    (work / f"{name}.out").write_bytes(output)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark client failed:\n{output.decode()[-3000:]}")
    result = json.loads((work / f"{name}.json").read_text())
    errors = [e for e in result.get("errors", []) if e]
    per_engine: dict[str, dict[str, Any]] = {}
    hits = queries = 0.0
    for engine, b, a, peak in zip(engines, before, after, peaks, strict=True):
        h = a.get("prefix_hits", 0.0) - b.get("prefix_hits", 0.0)
        q = a.get("prefix_queries", 0.0) - b.get("prefix_queries", 0.0)
        hits, queries = hits + h, queries + q
        per_engine[engine.name] = {
            "hit_rate": hit_rate(h, q),
            "prefix_hits": h,
            "prefix_queries": q,
            "preemptions": a.get("preemptions", 0.0) - b.get("preemptions", 0.0),
            "requests": a.get("requests", 0.0) - b.get("requests", 0.0),
            "peak_kv": peak["kv"],
            "peak_running": peak["running"],
            "peak_waiting": peak["waiting"],
        }
    return {
        "mode": mode,
        "completed": result["completed"],
        "failed": result.get("failed", args.prompts - result["completed"]),
        "first_error": errors[0][:200] if errors else None,
        "duration_s": result["duration"],
        "output_tok_s": result["output_throughput"],
        "mean_ttft_s": result["mean_ttft_ms"] / 1000,
        "p90_ttft_s": result["p90_ttft_ms"] / 1000,
        "mean_e2el_s": result["mean_e2el_ms"] / 1000,
        "hit_rate": hit_rate(hits, queries),
        "engines": per_engine,
        # The machine's 1-minute load at the end: other work shares its two CPUs.
        "load_1m": os.getloadavg()[0],
    }


async def run_mode(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Fresh engines, one client run in `mode`, everything stopped again."""
    engines = [Engine("A", "0")] if mode == "one-engine" else [Engine("A", "0"), Engine("B", "1")]
    gateway: subprocess.Popen[bytes] | None = None
    proxy: RoundRobinProxy | None = None
    port = free_port()
    target = f"http://127.0.0.1:{port}"
    try:
        await asyncio.gather(*(engine.serve(work) for engine in engines))
        if mode == "one-engine":
            target = engines[0].url
        elif mode == "round-robin":
            proxy = RoundRobinProxy([e.url for e in engines])
            await proxy.start(port)
        else:
            gateway = start_gateway(engines, mode == "kvgate", port, work)
            await burst.wait_ready(target, "/readyz", 60)
        row = await measure(mode, target, engines, args, work)
        if proxy is not None:
            names = {e.url: e.name for e in engines}
            row["sent"] = {names[u]: n for u, n in sorted(proxy.sent.items())}
        if gateway is not None:
            async with httpx.AsyncClient(timeout=5.0) as client:
                state = (await client.get(target + "/admin/state")).json()
            row["index"] = prefix_state(state)
            await asyncio.sleep(1.0)  # the access lines are flushed on a timer
            burst.stop(gateway)
            gateway = None
            log = (work / f"kvgate-{port}.log").read_text(errors="replace")
            row["placements"] = placements(
                access_records(log), {f":{e.port}": e.name for e in engines}
            )
        return row
    finally:
        if proxy is not None:
            await proxy.close()
        if gateway is not None:
            burst.stop(gateway)
        for engine in engines:
            engine.stop()


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="prefix-real-"))
    rows = []
    for _ in range(args.runs):
        for mode in args.modes:
            row = await run_mode(mode, args, work)
            row["setup"] = setup(args)
            row["at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"logs and client JSON in {work}", file=sys.stderr)
    return rows


def setup(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "prompts": args.prompts,
        "prefixes": args.prefixes,
        "prefix_tokens": args.input,
        "suffix_tokens": args.suffix,
        "output_tokens": args.output,
        "rate": args.rate,
        "seed": args.seed,
    }


# ---- the report -------------------------------------------------------------------------

SUMMARY_HEAD = (
    "| mode | runs | served | duration s, median (min-max) | TTFT p90 s | hit rate"
    " | hit / one engine | prefilled k tokens | preemptions |"
)
SUMMARY_RULE = "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"
HEAD = (
    "| mode | at | load | ok / failed | duration s | output tok/s | TTFT mean | TTFT p90"
    " | E2E mean | hit A | hit B | hit | prefilled k | preemptions A / B | requests A / B |"
)
RULE = "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"  # noqa: E501
NOTES = [
    "### How these were run",
    "",
    "Two engines from `scripts/real-vllm/serve.sh` (the tiny random-weight model, 4,096 KV"
    " tokens = 128 blocks of 32 each, max 32 sequences, `--enforce-eager"
    " --enable-prefix-caching --kv-events-config` with each its own publisher and replay"
    " port), A pinned to CPU 0, B to CPU 1, started afresh for every run; one invocation"
    " per run, modes alternating:",
    "",
    "```sh",
    "export PATH=/work/main/.venv/bin:$PATH PYTHONPATH=$PWD/src",
    "for mode in one-engine round-robin kvgate kvgate-approx; do",
    "  flock /work/wt/engine.lock python benchmarks/prefix_routing/real.py --modes $mode",
    "done   # repeated; then: python benchmarks/prefix_routing/real.py --report",
    "```",
    "",
    "The client is vLLM's own (`vllm.benchmarks.serve --dataset-name prefix_repetition"
    " --prefix-repetition-prefix-len 1000 --prefix-repetition-suffix-len 100"
    " --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 150 --num-prompts 64"
    " --request-rate inf --ignore-eos --seed 0`, the command `client_command` of"
    " benchmarks/vllm_burst/run.py builds). `round-robin` is the pass-through proxy of"
    " `real.py`, not kvgate's `round-robin` baseline, which would still count every prompt"
    " with the engine's `/tokenize`, queue and relay it. kvgate runs with its defaults: no"
    " tokenizer configured, so each prompt's ids come from the engine's `/tokenize`.",
    "",
    "### Reading",
    "",
    "- Every request completed in every mode.",
    "- Hit rate: kvgate's 66.8% (median) is 1.04x what one engine alone reaches (64.3%),"
    " where round-robin reaches 0.96x; kvgate without KV events (`kvgate-approx`) 1.03x."
    " One engine cannot do better: its 128 blocks hold the 4 prefixes (124 blocks) only with"
    " nothing running beside them, so prefixes are evicted and computed again; two engines"
    " hold two each. The ceiling of the trace is 85% (every prompt but each prefix's first"
    " finds its 992 tokens of full blocks cached).",
    "- Duration: kvgate does not beat round-robin here. In the quietest rounds (load 2.9-4.4,"
    " 07:40-07:50) round-robin took 7.4, 8.6 and 8.1 s, kvgate 11.3, 10.9 and 11.6 s"
    " (1.4x); the medians over all runs (10.8 s against 11.4 s) are within the machine's"
    " noise, not evidence of parity. kvgate keeps each engine's planned KV under its"
    " capacity, a request's 150 output tokens reserved from its start: on each engine"
    " requests run in waves that start and end together (the same lengths), 6-10 at the"
    " peak, 4.9-5.5 on average (07:42 run, from the access log), each wave's prefill with no"
    " decode beside it; mean TTFT is mostly the wait in kvgate's queue (4.1-6.5 s of"
    " 4.3-6.8 s). Round-robin keeps 7-8 running on each engine and lets vLLM preempt"
    " (23-37 per run), which costs little here: a preempted request's 1,000-token prefix"
    " stays cached, and the model is tiny. The issue's first measurement, under other"
    " conditions (engines not pinned), had kvgate at 20.8 s and 54% hits, nginx at 9.4 s"
    " and 59%.",
    "- Prefilled tokens (first prefills, the work left to the engines whatever the"
    " machine's speed): kvgate 23.4k against round-robin's 26.8k (13% less); round-robin's"
    " recomputation after its preemptions is not in this count (vLLM counts a preempted"
    " request's lookups apart).",
    "- Events arrived: through kvgate with `kv_events`, its index held 110-126 blocks per"
    " engine (of 128) at the end, no resync, and the prompt share it predicted cached was"
    " within 0.11 of the engines' own hit rate, always at or under it (a prompt's blocks"
    " are in the index once the engine has stored them, after its prefill). Without events"
    " the index of kvgate's own placements over-predicts by up to 0.11 (it sees no"
    " eviction) but places as well on this trace: placement, not the index, bounds the hit"
    " rate here. Both split the requests unevenly at times (with events 26/38 and 27/37,"
    " without 29/35 twice and 27/37, of six runs each).",
    "- What limits the figures: a 2-vCPU machine shared with other engineers' work (the"
    " 1-minute load was 2.7-9.7; the same mode's duration varies 2-3x from run to run),"
    " engines pinned to both CPUs so that kvgate, the proxy and the client share them with"
    " the engines; a 4,096-token cache against 1,250-token requests, so every mode is bound"
    " by KV room; a tiny model whose preemptions are cheap, which favours round-robin's"
    " overbooking more than a GPU engine's would.",
]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def prefilled(row: dict[str, Any]) -> float:
    """Prompt tokens the engines computed on each request's first prefill (queried less
    found cached): the prefill a routing leaves, whatever the machine's speed. vLLM counts
    a preempted request's lookups apart, so its recomputation is not in it (nor in the
    hit rate)."""
    return float(sum(e["prefix_queries"] - e["prefix_hits"] for e in row["engines"].values()))


def table_row(row: dict[str, Any]) -> str:
    e = row["engines"]
    a, b = e.get("A", {}), e.get("B", {})
    load = row.get("load_1m")

    def pair(key: str) -> str:
        return " / ".join(f"{x[key]:.0f}" for x in (a, b) if x)

    return (
        f"| {row['mode']} | {row['at'][11:16]} | {'-' if load is None else f'{load:.1f}'}"
        f" | {row['completed']} / {row['failed']} | {row['duration_s']:.1f}"
        f" | {row['output_tok_s']:.0f} | {row['mean_ttft_s']:.2f} | {row['p90_ttft_s']:.2f}"
        f" | {row['mean_e2el_s']:.2f} | {_pct(a.get('hit_rate'))} | {_pct(b.get('hit_rate'))}"
        f" | {_pct(row['hit_rate'])} | {prefilled(row) / 1000:.1f} | {pair('preemptions')}"
        f" | {pair('requests')} |"
    )


def summary_row(mode: str, runs: list[dict[str, Any]], one_engine: float | None) -> str:
    durations = [r["duration_s"] for r in runs]
    hit = statistics.median(r["hit_rate"] for r in runs)
    served = sum(r["completed"] for r in runs)
    asked = served + sum(r["failed"] for r in runs)
    preemptions = statistics.median(
        sum(e["preemptions"] for e in r["engines"].values()) for r in runs
    )
    return (
        f"| {mode} | {len(runs)} | {served} / {asked}"
        f" | {statistics.median(durations):.1f} ({min(durations):.1f}-{max(durations):.1f})"
        f" | {statistics.median(r['p90_ttft_s'] for r in runs):.1f} | {_pct(hit)}"
        f" | {'-' if not one_engine else f'{hit / one_engine:.2f}'}"
        f" | {statistics.median(prefilled(r) for r in runs) / 1000:.1f} | {preemptions:.0f} |"
    )


def section(rows: list[dict[str, Any]]) -> list[str]:
    """The "Real engines" section of results.md: per setup, the medians of each mode, then
    every run in the order they ran, then where kvgate sent the requests."""
    lines = [SECTION, ""]
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_setup.setdefault(json.dumps(row["setup"], sort_keys=True), []).append(row)
    for key, group in by_setup.items():
        s = json.loads(key)
        by_mode = {m: [r for r in group if r["mode"] == m] for m in MODES}
        ones = [r["hit_rate"] for r in by_mode["one-engine"]]
        one = statistics.median(ones) if ones else None
        lines += [
            f"### `prefix_repetition`: {s['prefixes']} prefixes of {s['prefix_tokens']:,}"
            f" tokens, suffix {s['suffix_tokens']}, output {s['output_tokens']},"
            f" {s['prompts']} prompts at rate {s['rate']}",
            "",
            SUMMARY_HEAD,
            SUMMARY_RULE,
            *(summary_row(m, runs, one) for m, runs in by_mode.items() if runs),
            "",
            "Every run (`at`: its end, UTC; `load`: the machine's 1-minute load average then):",
            "",
            HEAD,
            RULE,
            *(table_row(r) for r in group),
            "",
        ]
        routed = [r for r in group if "placements" in r]
        if routed:
            lines += [
                "Through kvgate (its access log): requests per engine, how they were placed"
                " (`cached`: where the index predicted part of the prompt cached), the share"
                " of prompt tokens predicted cached, the mean wait in kvgate's queue:",
                "",
                "| run | at | requests A / B | placed by | predicted cached | queued mean s |",
                "| --- | --- | --- | --- | ---: | ---: |",
            ]
            for r in routed:
                p = r["placements"]
                by = ", ".join(f"{k} {v}" for k, v in sorted(p["by"].items()))
                lines.append(
                    f"| {r['mode']} | {r['at'][11:16]}"
                    f" | {' / '.join(map(str, p['requests'].values()))}"
                    f" | {by} | {_pct(p['predicted_cached'])} | {p['mean_queue_s']:.2f} |"
                )
            lines.append("")
    return lines + NOTES


def write_report(rows: list[dict[str, Any]]) -> None:
    text = REPORT.read_text() if REPORT.exists() else ""
    head = text.split(SECTION, 1)[0].rstrip("\n")
    REPORT.write_text(head + "\n\n" + "\n".join(section(rows)).rstrip("\n") + "\n")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--input", type=int, default=1000, help="tokens of each prefix")
    parser.add_argument("--suffix", type=int, default=100)
    parser.add_argument("--output", type=int, default=150)
    parser.add_argument("--rate", default="inf", help="requests/s (inf: all at once)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", action="store_true", help="only write results.md")
    args = parser.parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    return args


if __name__ == "__main__":
    options = parse()
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    if not options.report:
        previous += asyncio.run(main(options))
        RESULTS.write_text(json.dumps(previous, indent=1) + "\n")
    write_report(previous)
