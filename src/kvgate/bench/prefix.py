"""Routings compared on shared-prefix traffic, in virtual time (`kvgate bench prefix`).

Engines with prefix caching (the preset with `enable_prefix_caching`) serve one of the
shared-prefix workloads of `kvgate.sim.prefix_workloads` (`WORKLOADS`):

- `chats`: multi-turn conversations (a system prompt, each turn the history plus 200 new
  tokens, 300 out, the next turn a think time after the answer), a closed loop whose size
  is the number of conversations;
- `rag`: questions over a few documents (a 4k-token document and a 100-token question);
- `tenants`: each of 8 tenants' requests start with its own 1k-token system prompt;
- `hot-prefix`: 80 % of the traffic on one 1k-token prefix, the rest on 7 others;

the open-loop ones Poisson at `--rate` for `--duration` seconds. Traffic starts at
`START_S`, once every gateway replica has scraped the engines (a request before that
finds no node known).

Each `Routing` names a placement policy and how the gateway around it runs; `ROUTINGS`
holds the ones compared by name (a prefix-aware routing registers there with one line:
its policy name, its settings, `kv_events=True` if it reads the engines' KV events, which
the virtual runner then hands to it in-process).

`score` gives a run's headline figures: output throughput (output tokens of answered
requests over the time from the first arrival to the last answer), TTFT p50/p90, the
engines' prefix-cache hit rate (`prefix_cache_hits / prefix_cache_queries`) against the
ideal (one unbounded cache on the same trace, `ideal_hit_rate`), preemptions, and per
engine its KV peak and the time it sat idle while another engine or the gateway's queue
held waiting requests (a hot spot's signature). `turn_moves` counts, for chats, how often
a conversation's next turn left the engine that caches its history, by whether one
replica or two placed the two turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.core.policies.baselines import PolicyName
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.sim.model.engine import EngineConfig
from kvgate.sim.prefix_workloads import (
    Chats,
    ChatSpec,
    PrefixMix,
    hot_prefix,
    ideal_hit_rate,
    prefix_mix,
)
from kvgate.sim.presets import get_preset
from kvgate.sim.runs import NO_QUEUE, ClientModel, VirtualConfig, VirtualResult
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import FollowUps, RequestSpec, WorkloadSpec

REPO = Path(__file__).resolve().parents[3]
#: When traffic starts (virtual seconds): after every replica's first scrape has landed.
START_S = 1.0
#: Clients wait as long as it takes: the comparison scores placement, not refusals.
CLIENT = ClientModel(timeout_s=600.0, max_attempts=20, max_429_tries=20)
#: How long a run may go on after its last open-loop arrival (or, for chats, at all).
DRAIN_S = 600.0
CHATS_HORIZON_S = 1200.0


@dataclass(frozen=True)
class Routing:
    """How requests are placed: a policy by name, its settings, the gateway's queue."""

    policy: PolicyName
    queue: QueueSettings = field(default_factory=QueueSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    kv_events: bool = False  # the policy reads the engines' KV events (`KVEventSink`)


ROUTINGS: dict[str, Routing] = {
    "round-robin": Routing("round-robin", NO_QUEUE),
    "least-loaded": Routing("none", NO_QUEUE),
    "headroom-only": Routing("headroom-only"),
    "prefix-aware": Routing("prefix-aware", kv_events=True),
    "prefix-approx": Routing("prefix-aware"),
}


@dataclass(frozen=True)
class Traffic:
    """One run's requests: the first arrivals, what follows answers, every request by id."""

    arrivals: list[RequestSpec]
    follow_ups: FollowUps | None
    issued: dict[str, RequestSpec]
    duration_s: float  # the last open-loop arrival's bound (0: a closed loop)


def chats(spec: ChatSpec, seed: int) -> Traffic:
    conversations = Chats(spec, seed=seed)
    first = _started(conversations.first_turns())
    return Traffic(first, conversations, conversations.issued, 0.0)


def open_loop(mix: PrefixMix, duration_s: float, seed: int) -> Traffic:
    arrivals = _started(list(prefix_mix(mix, duration_s, seed)))
    return Traffic(arrivals, None, {a.id: a for a in arrivals}, START_S + duration_s)


def _started(requests: Sequence[RequestSpec]) -> list[RequestSpec]:
    return [dataclasses.replace(r, arrival=r.arrival + START_S) for r in requests]


def rag(rate_rps: float) -> PrefixMix:
    return PrefixMix(rate_rps, prefixes=4, prefix_tokens=4000, suffix_tokens=100,
                     output_tokens=200)  # fmt: skip


def tenants(rate_rps: float) -> PrefixMix:
    return PrefixMix(rate_rps, prefixes=8, prefix_tokens=1000, suffix_tokens=200,
                     output_tokens=300, per_tenant=True)  # fmt: skip


def hot(rate_rps: float) -> PrefixMix:
    return hot_prefix(rate_rps, prefixes=8, hot=0.8, prefix_tokens=1000, suffix_tokens=200,
                      output_tokens=300)  # fmt: skip


#: The open-loop workloads by name, each a mix at a rate.
MIXES: dict[str, Callable[[float], PrefixMix]] = {"rag": rag, "tenants": tenants, "hot-prefix": hot}
WORKLOADS = ("chats", *MIXES)


def traffic(
    workload: str, seed: int, conversations: int = 200, rate_rps: float = 10.0,
    duration_s: float = 60.0,
) -> Traffic:  # fmt: skip
    """A workload's requests by name (`WORKLOADS`). Raises KeyError."""
    if workload == "chats":
        return chats(ChatSpec(conversations=conversations), seed)
    if workload not in MIXES:
        raise KeyError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    return open_loop(MIXES[workload](rate_rps), duration_s, seed)


def caching(engine: EngineConfig | str) -> EngineConfig:
    """An engine (or a preset, by name) with prefix caching on."""
    config = get_preset(engine) if isinstance(engine, str) else engine
    return dataclasses.replace(config, enable_prefix_caching=True)


def configure(
    routing: Routing, load: Traffic, engine: EngineConfig, nodes: int, seed: int,
    series_s: float = 0.5,
) -> VirtualConfig:  # fmt: skip
    """The virtual run that plays `load` on `nodes` engines under `routing` (one replica)."""
    horizon = load.duration_s or CHATS_HORIZON_S
    return VirtualConfig(
        engine=engine, workload=WorkloadSpec(), duration_s=horizon, nodes=nodes,
        policy=routing.policy, admission=routing.admission, queue=routing.queue,
        client=CLIENT, kv_events=routing.kv_events, series_interval_s=series_s, seed=seed,
        drain_s=DRAIN_S if load.duration_s else 0.0,
    )  # fmt: skip


def run(
    routing: Routing, load: Traffic, engine: EngineConfig, nodes: int, seed: int,
    series_s: float = 0.5,
) -> dict[str, Any]:  # fmt: skip
    """Play `load` on `nodes` engines under `routing`; its `score`."""
    config = configure(routing, load, engine, nodes, seed, series_s)
    result = VirtualCluster(config, load.arrivals, load.follow_ups).run()
    return scored(result, load, routing)


def scored(result: VirtualResult, load: Traffic, routing: Routing) -> dict[str, Any]:
    """A run's `score` and its `engine_stats`."""
    config = result.config
    out = score(result, load.issued, config.engine.block_size)
    out.update(engine_stats(result, config.series_interval_s, routing.admission.panic_watermark))
    return out


def score(result: VirtualResult, issued: dict[str, RequestSpec], block_size: int) -> dict[str, Any]:
    """The headline figures of one run (see the module docstring)."""
    ok = [o for o in result.outcomes if o.status == "ok"]
    if not ok:
        raise RuntimeError("no request was answered")
    first = min(o.arrival for o in result.outcomes)
    end = max((o.completed_at or 0.0) for o in ok)
    ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
    started = sorted(
        (o.tries[-1].start, issued[o.id].prompt_ids or (), o.output_tokens) for o in ok
    )
    queries, hits = ideal_hit_rate(((ids, n) for _, ids, n in started), block_size)
    totals = result.engine_totals
    hit_rate = totals["prefix_cache_hits"] / max(1, totals["prefix_cache_queries"])
    ideal = hits / max(1, queries)
    return {
        "requests": len(result.outcomes),
        "ok": len(ok),
        "duration_s": end - first,
        "output_tok_per_s": sum(o.output_tokens for o in ok) / max(1e-9, end - first),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
        "hit_rate": hit_rate,
        "ideal_hit_rate": ideal,
        "hit_vs_ideal": hit_rate / ideal if ideal else 0.0,
        "preemptions": totals["preemptions"],
        "refused_429": sum(o.rejections_429 for o in result.outcomes),
        "wall_s": result.wall_s,
    }


def turn_moves(result: VirtualResult) -> dict[str, Any]:
    """How often a conversation's next turn (its prompt: the previous turn's prompt and
    answer, cached where that turn ran, and a new message) went to another engine than the
    previous turn; split by whether two replicas placed the pair (`across`: two replicas
    sending one prefix to different engines) or one (`within`). Answered turns only."""
    placed: dict[tuple[int, int], tuple[str | None, int | None]] = {}
    for o in result.outcomes:
        if o.status == "ok" and o.tries:
            c, t = o.id[1:].split("-t")
            placed[int(c), int(t)] = (o.tries[-1].node, o.tries[-1].replica)
    pairs = {"across": 0, "within": 0}
    moved = {"across": 0, "within": 0}
    for (conv, turn), (node, replica) in placed.items():
        before = placed.get((conv, turn - 1))
        if before is not None:
            kind = "within" if before[1] == replica else "across"
            pairs[kind] += 1
            moved[kind] += before[0] != node
    return {
        "pairs_across": pairs["across"],
        "moved_across": moved["across"] / max(1, pairs["across"]),
        "pairs_within": pairs["within"],
        "moved_within": moved["within"] / max(1, pairs["within"]),
    }


def engine_stats(result: VirtualResult, interval_s: float, panic: float) -> dict[str, Any]:
    """Per engine: its KV peak, and the seconds it ran nothing while requests waited in
    another engine or in the gateway's queue; and how many engines went above `panic`."""
    points = result.series
    nodes = len(points[0].node_kv_usage) if points else 0
    peaks = [max(p.node_kv_usage[i] for p in points) for i in range(nodes)]
    idle = [0.0] * nodes
    for p in points:
        waiting = sum(p.node_waiting) + p.queued
        for i in range(nodes):
            if p.node_running[i] == 0 and waiting - p.node_waiting[i] > 0:
                idle[i] += interval_s
    return {"kv_peak": peaks, "above_panic": sum(k > panic for k in peaks),
            "idle_while_queued_s": idle}  # fmt: skip


# --- the report ------------------------------------------------------------------------------

HEAD = ("| routing | output tok/s | TTFT p50 | TTFT p90 | hit rate | ideal | hit / ideal "
        "| preemptions | ok / requests | 429s |")  # fmt: skip
RULE = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"


def row(name: str, r: dict[str, Any]) -> str:
    """One line of the headline table (`HEAD`)."""
    return (
        f"| {name} | {r['output_tok_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | "
        f"{r['ttft_p90_s']:.3f} | {r['hit_rate']:.1%} | {r['ideal_hit_rate']:.1%} | "
        f"{r['hit_vs_ideal']:.2f} | {r['preemptions']} | {r['ok']} / {r['requests']} | "
        f"{r['refused_429']} |"
    )


def engine_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Per routing: each engine's KV peak and idle time while others queued."""
    lines = [
        "| routing | KV peak per engine | engines above panic | idle while others queue (s) |",
        "| --- | --- | ---: | --- |",
    ]
    for name, r in rows.items():
        peaks = " ".join(f"{k:.2f}" for k in r["kv_peak"])
        idle = " ".join(f"{t:.1f}" for t in r["idle_while_queued_s"])
        lines.append(f"| {name} | {peaks} | {r['above_panic']} | {idle} |")
    return lines


def brief(r: dict[str, Any]) -> str:
    """One run in a line, for progress output."""
    return (
        f"{r['output_tok_per_s']:.0f} tok/s, TTFT p90 {r['ttft_p90_s']:.2f} s, "
        f"hits {r['hit_rate']:.0%} of ideal {r['ideal_hit_rate']:.0%}, "
        f"{r['preemptions']} preemptions, {r['ok']}/{r['requests']} ok"
    )


def plot(groups: dict[str, dict[str, dict[str, Any]]], title: str, path: Path) -> None:
    """Bars of throughput, TTFT p90 and hit rate / ideal: one group of routings per key of
    `groups` (a load, a seed). Needs matplotlib (the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(groups)
    names = list(groups[keys[0]])
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    metrics = (("output_tok_per_s", "output tokens/s"), ("ttft_p90_s", "TTFT p90 (s)"),
               ("hit_vs_ideal", "hit rate / ideal"))  # fmt: skip
    for ax, (metric, label) in zip(axes, metrics, strict=True):
        for j, name in enumerate(names):
            xs = [i + j * width for i in range(len(keys))]
            ax.bar(xs, [groups[k][name][metric] for k in keys], width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels([k.replace(", ", "\n") for k in keys])  # a line per part
        ax.set_title(label)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names))
    fig.suptitle(title)
    fig.tight_layout(rect=(0.0, 0.07, 1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out: Path, title: str, command: str, setup: dict[str, Any],
    results: dict[str, dict[str, dict[str, Any]]],
) -> Path:  # fmt: skip
    """`results.json`, `report.md` and `routing.png` in `out`: one table per seed
    (`results[seed][routing]`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"setup": setup, "runs": results}, indent=1))
    lines = [f"# {title}", "", f"    {command}", ""]
    lines += [f"- {k}: {v}" for k, v in setup.items()]
    for seed, rows in results.items():
        lines += ["", f"## Seed {seed}", "", HEAD, RULE, *(row(n, r) for n, r in rows.items())]
        lines += ["", *engine_table(rows)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    plot({f"seed {seed}": rows for seed, rows in results.items()}, title, out / "routing.png")
    return report


# --- `kvgate bench prefix` -------------------------------------------------------------------


def main_prefix(args: argparse.Namespace, command: str) -> Path:
    """Run `kvgate bench prefix` (options checked by `kvgate.bench.cli`); the report's path."""
    quick = bool(args.quick)
    nodes = args.nodes or (2 if quick else 8)
    preset = args.preset or "gpu-8b"
    engine = caching(preset)
    seeds = args.seeds or [1]
    names = args.policies or list(ROUTINGS)
    conversations = args.conversations or (20 if quick else 150) * nodes
    rate = args.rate or (5.0 if quick else 18.75) * nodes
    duration = args.duration or (10.0 if quick else 60.0)
    workload = args.workload
    out = args.out or REPO / "benchmarks" / "prefix_routing" / "results" / (
        workload + ("-quick" if quick else "")
    )
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for seed in seeds:
        for name in names:
            t0 = time.perf_counter()
            load = traffic(workload, seed, conversations, rate, duration)
            r = run(ROUTINGS[name], load, engine, nodes, seed)
            results.setdefault(str(seed), {})[name] = r
            print(f"{workload} seed {seed} {name}: {brief(r)} ({time.perf_counter() - t0:.0f} s)")
    what = (
        f"{conversations} conversations x 5 turns (1k-token system prompt, 200 in, 300 out)"
        if workload == "chats"
        else f"{rate:g} requests/s for {duration:g} s"
    )
    setup = {
        "engines": f"{nodes} x `{preset}` with prefix caching",
        "workload": f"{workload}: {what}",
        "routings": ", ".join(names),
        "seeds": ", ".join(map(str, seeds)),
    }
    title = f"Routings on shared-prefix traffic ({workload}), virtual time"
    return write_report(out, title, command, setup, results)
