"""On the real vLLM engine: of the tokens no departed client read, which came after it left?

The overload benchmark estimates zombie tokens on vLLM as "generated minus read", which also
holds tokens made *before* a client left that it never read (in vLLM's server, the relay or
socket buffers). This separates the two with vLLM's own counter, in trials of N streams
that all leave at one instant T:

- every client counts the tokens it read (`return_token_ids`: vLLM merges several tokens
  into one event when its server lags);
- `vllm:generation_tokens_total` is read right before they leave, right after, and once
  the engine is idle again. vLLM counts a token when its server takes it from the engine
  core, before sending it, and stops counting a request when it aborts it. So the tokens
  counted after the leave (zombies) are at least `final - post` and at most
  `final - max(pre, read)`; `final - read` is everything the clients never read.

Runs `direct` and through `kvgate serve` (adaptive). Starts the engine itself (under the
machine-wide lock) and stops everything it started.

    python benchmarks/zombie_split/bench.py [--trials 10] [--streams 10]   # rewrites results.md
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import orjson

from kvgate.bench.live.driver import LOGS, _real_vllm, _wait_idle, kvgate_cmd, start, wait_healthy
from kvgate.bench.live.poll import parse_metrics
from kvgate.procs.ports import free_port

HERE = Path(__file__).resolve().parent
GEN = "vllm:generation_tokens_total"


@dataclass
class Trial:
    """One trial: N streams that leave together; token counts relative to its start."""

    setup: str
    streams: int
    read: int  # tokens the clients had read when they left
    pre: float  # the engine's count at a scrape right before they left
    post: float  # ... at a scrape right after they left
    final: float  # ... once the engine was idle again
    relayed_unread_events: float = float("nan")  # kvgate relayed them; clients never read
    close_ms: float = float("nan")  # kvgate: client disconnect -> upstream closed, mean
    post_s: float = float("nan")

    @property
    def zombie_high(self) -> float:
        """Counted after the leave, at most: tokens read were counted before it."""
        return self.final - max(self.pre, self.read)

    @property
    def zombie_low(self) -> float:
        """Counted after the leave, at least: after the scrape that followed it."""
        return max(0.0, self.final - self.post)

    @property
    def never_read(self) -> float:
        return self.final - self.read


async def _metrics(session: aiohttp.ClientSession, engine: str) -> dict[str, float]:
    async with session.get(engine + "/metrics") as resp:
        names = (GEN, "vllm:num_requests_running", "vllm:num_requests_waiting")
        return parse_metrics(await resp.text(), names)


async def _reader(
    resp: aiohttp.ClientResponse, counts: list[int], events: list[int], i: int
) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        choices = orjson.loads(line[5:]).get("choices") or []
        if choices:
            ids = choices[0].get("token_ids")
            counts[i] += len(ids) if isinstance(ids, list) else 1
            events[i] += 1


async def _trial(
    url: str, engine: str, model: str, streams: int, leave_after_s: float
) -> TrialCounts:
    rng = np.random.default_rng(streams)
    body = {
        "model": model,
        "max_tokens": 220,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0.0,
    }
    counts = [0] * streams
    events = [0] * streams
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as clients, aiohttp.ClientSession() as probe:
        base = (await _metrics(probe, engine)).get(GEN, 0.0)  # the engine is idle here
        resps = []
        for _ in range(streams):
            prompt = rng.integers(100, 8000, 40).tolist()
            payload = orjson.dumps({**body, "prompt": prompt})
            resp = await clients.post(
                url + "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
            )
            if resp.status != 200:
                raise RuntimeError(f"stream refused: {resp.status} {await resp.text()}")
            resps.append(resp)
        readers = [asyncio.create_task(_reader(r, counts, events, i)) for i, r in enumerate(resps)]
        await asyncio.sleep(leave_after_s)
        pre = (await _metrics(probe, engine)).get(GEN, 0.0)
        for task in readers:
            task.cancel()
        read = sum(counts)
        left_at = time.monotonic()
        for resp in resps:
            resp.close()  # the connection is closed: vLLM (or kvgate) sees a disconnect
        post = (await _metrics(probe, engine)).get(GEN, 0.0)
        post_s = time.monotonic() - left_at
        await asyncio.gather(*readers, return_exceptions=True)
    await _wait_idle([engine], timeout_s=20.0)
    await asyncio.sleep(0.5)
    async with aiohttp.ClientSession() as probe:
        final = (await _metrics(probe, engine)).get(GEN, 0.0)
    return TrialCounts(read, sum(events), pre - base, post - base, final - base, post_s)


@dataclass
class TrialCounts:
    read: int
    events: int
    pre: float
    post: float
    final: float
    post_s: float  # from the leave until the second scrape had returned


async def _model(engine: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(engine + "/v1/models") as r:
        return str((await r.json())["data"][0]["id"])


GW = (
    "kvgate_client_gone_stream_events_total",
    "kvgate_cancel_propagation_seconds_sum",
    "kvgate_cancel_propagation_seconds_count",
)


async def _relay(gateway: str | None) -> dict[str, float]:
    """The gateway's own count of what it relayed to clients that left, and how fast it
    closed their upstream requests (empty without a gateway)."""
    if gateway is None:
        return {}
    async with aiohttp.ClientSession() as s, s.get(gateway + "/metrics") as r:
        return parse_metrics(await r.text(), GW)


def _run_setup(
    setup: str, url: str, engine: str, gateway: str | None, args: argparse.Namespace
) -> list[Trial]:
    model = asyncio.run(_model(engine))
    out = []
    for _ in range(args.trials):
        g0 = asyncio.run(_relay(gateway))
        c = asyncio.run(_trial(url, engine, model, args.streams, args.leave_after))
        g1 = asyncio.run(_relay(gateway))
        gd = {k: g1.get(k, 0.0) - g0.get(k, 0.0) for k in GW}
        relayed = gd[GW[0]] if gateway else float("nan")
        closes = gd[GW[2]]
        close_ms = 1000 * gd[GW[1]] / closes if closes else float("nan")
        trial = Trial(setup, args.streams, c.read, c.pre, c.post, c.final)
        trial.relayed_unread_events = relayed - c.events
        trial.close_ms = close_ms
        trial.post_s = c.post_s
        out.append(trial)
        print(
            f"{setup}: read {c.read} in {c.events} events, never read {trial.never_read:.0f}, "
            f"counted after leaving {trial.zombie_low:.0f}-{trial.zombie_high:.0f}; relayed "
            f"but unread events {trial.relayed_unread_events:.0f}, relay closed upstream "
            f"{close_ms:.1f} ms after the client, second scrape {1000 * c.post_s:.0f} ms "
            "after the leave",
            flush=True,
        )
    return out


def _gateway(engine: str) -> tuple[object, str]:
    port = free_port()
    env = {
        "KVGATE_BACKENDS": orjson.dumps([{"url": engine}]).decode(),
        "KVGATE_SERVER__LISTEN": f"127.0.0.1:{port}",
        "KVGATE_SERVER__LOG_LEVEL": "warning",
        "KVGATE_SCRAPE__INTERVAL_S": "0.2",
    }
    gw = start(kvgate_cmd("serve"), "kvgate serve", LOGS / "zombie-split-serve.log", env)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(wait_healthy(url + "/healthz", gw, 30.0))
    time.sleep(1.0)
    return gw, url


def _table(trials: list[Trial]) -> list[str]:
    lines = [
        "| path | trials | streams | tokens read per stream | never read, per stream | "
        "counted after leaving, per stream: at least | at most (mean) | at most (worst trial) "
        "| events kvgate relayed that clients never read, per stream | kvgate closed upstream "
        "after the client, mean ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setup in dict.fromkeys(t.setup for t in trials):
        group = [t for t in trials if t.setup == setup]
        n = group[0].streams
        high = [t.zombie_high / n for t in group]
        unread = [t.relayed_unread_events / n for t in group]
        closes = [t.close_ms for t in group if not math.isnan(t.close_ms)]
        lines.append(
            f"| {setup} | {len(group)} | {n} | {statistics.mean(t.read for t in group) / n:.0f} | "
            f"{statistics.mean(t.never_read for t in group) / n:.1f} | "
            f"{statistics.mean(t.zombie_low for t in group) / n:.2f} | "
            f"{statistics.mean(high):.2f} | {max(high):.1f} | "
            f"{'-' if math.isnan(unread[0]) else f'{statistics.mean(unread):.1f}'} | "
            f"{f'{statistics.mean(closes):.1f}' if closes else '-'} |"
        )
    return lines


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument("--leave-after", type=float, default=1.5, help="seconds of streaming")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the engine and gateway started here are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    load = os.getloadavg()
    trials: list[Trial] = []
    with _real_vllm() as engines:
        engine = engines[0]
        trials += _run_setup("direct", engine, engine, None, args)
        gw, url = _gateway(engine)
        try:
            trials += _run_setup("kvgate (adaptive)", url, engine, url, args)
        finally:
            gw.stop()  # type: ignore[attr-defined]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"Run: {stamp}, {platform.machine()}, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; real vLLM CPU engine (`serve.sh` defaults), "
        f"{args.streams} streams of 40 prompt tokens, max_tokens 220, leaving together "
        f"after {args.leave_after:g} s.",
        "",
        *_table(trials),
    ]
    results = HERE / "results.md"
    text = results.read_text(encoding="utf-8") if results.exists() else ""
    head, sep, rest = text.partition("<!-- bench:start -->")
    tail = rest.partition("<!-- bench:end -->")[2] if sep else ""
    block = "<!-- bench:start -->\n" + "\n".join(lines) + "\n<!-- bench:end -->"
    results.write_text((head if sep else "") + block + tail, encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
