"""Routing by prefix cache, compared in virtual time (issue 24's "Done when").

Eight `gpu-8b` engines with prefix caching on (`kvgate.sim.model.prefix`) serve:

* **chats**: multi-turn conversations (`kvgate.sim.prefix_workloads.ChatSpec`): a 1k-token
  system prompt, 200 tokens in and 300 out per turn, 5 turns, the next turn a think time
  (1 s mean) after the answer; conversations start over the first 10 s. The number of
  conversations sets the load: `--conversations` (default 1200, near what round-robin can
  serve; 1600 is past it).
* **hot prefix**: open-loop traffic, 80 % of it on one 1k-token prefix and the rest on 7
  others, 200-token suffixes, 300 tokens out.

under each routing of `ROUTINGS`:

* `round-robin`, `least-loaded`: no admission control, each request straight to the next
  engine / to the one with the fewest requests in flight (the `round-robin` and `none`
  baselines);
* `headroom-only`: kvgate's `adaptive` policy behind its queue (routing by headroom);
* `prefix-aware`: kvgate with the prefix-aware routing part, once it exists: add it to
  `ROUTINGS` (one line: its policy name, its settings, `kv_events=True` if it reads the
  engines' KV events, which the runner then hands to it in-process).

Scored per routing: output throughput (output tokens of answered requests / time from the
first arrival to the last answer), TTFT p90, the engines' prefix-cache hit rate
(`prefix_cache_hits / prefix_cache_queries`) against the ideal (one unbounded cache on the
same trace, `ideal_hit_rate`), preemptions; for the hot prefix, each engine's KV peak and
the time it sat idle while another engine or the gateway's queue held waiting requests.

    python benchmarks/prefix_routing/run.py [--conversations N ...] [--quick]
    python benchmarks/prefix_routing/run.py --report  # results.md again from results.json

writes results.json, results.md and routing.png next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.core.policies.baselines import PolicyName
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.sim.model.engine import EngineConfig
from kvgate.sim.prefix_workloads import Chats, ChatSpec, hot_prefix, ideal_hit_rate, prefix_mix
from kvgate.sim.presets import GPU_8B
from kvgate.sim.runs import NO_QUEUE, ClientModel, VirtualConfig, VirtualResult
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import RequestSpec, WorkloadSpec

HERE = Path(__file__).resolve().parent
ENGINE: EngineConfig = dataclasses.replace(GPU_8B, enable_prefix_caching=True)
NODES = 8
SEED = 1
CLIENT = ClientModel(timeout_s=600.0, max_attempts=20, max_429_tries=20)


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


def _config(routing: Routing, horizon_s: float, series_s: float) -> VirtualConfig:
    return VirtualConfig(
        engine=ENGINE, workload=WorkloadSpec(), duration_s=horizon_s, nodes=NODES,
        policy=routing.policy, admission=routing.admission, queue=routing.queue,
        client=CLIENT, kv_events=routing.kv_events, series_interval_s=series_s, seed=SEED,
    )  # fmt: skip


def score(result: VirtualResult, issued: dict[str, RequestSpec]) -> dict[str, Any]:
    """The headline figures of one run (see the module docstring)."""
    ok = [o for o in result.outcomes if o.status == "ok"]
    first = min(o.arrival for o in result.outcomes)
    end = max((o.completed_at or 0.0) for o in ok)
    ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
    started = sorted(
        (o.tries[-1].start, issued[o.id].prompt_ids or (), o.output_tokens) for o in ok
    )
    queries, hits = ideal_hit_rate(((ids, n) for _, ids, n in started), ENGINE.block_size)
    totals = result.engine_totals
    hit_rate = totals["prefix_cache_hits"] / max(1, totals["prefix_cache_queries"])
    ideal = hits / max(1, queries)
    return {
        "requests": len(result.outcomes),
        "ok": len(ok),
        "duration_s": end - first,
        "output_tok_per_s": sum(o.output_tokens for o in ok) / (end - first),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[int(0.9 * len(ttfts))],
        "hit_rate": hit_rate,
        "ideal_hit_rate": ideal,
        "hit_vs_ideal": hit_rate / ideal if ideal else 0.0,
        "preemptions": totals["preemptions"],
        "refused_429": sum(o.rejections_429 for o in result.outcomes),
        "wall_s": result.wall_s,
    }


def run_chats(routing: Routing, spec: ChatSpec) -> dict[str, Any]:
    chats = Chats(spec, seed=SEED)
    cluster = VirtualCluster(_config(routing, 1200.0, 1.0), chats.first_turns(), chats)
    result = cluster.run()
    return score(result, chats.issued)


def run_hot(routing: Routing, rate_rps: float, duration_s: float) -> dict[str, Any]:
    mix = hot_prefix(rate_rps, prefixes=8, hot=0.8, prefix_tokens=1000, suffix_tokens=200,
                     output_tokens=300)  # fmt: skip
    arrivals = list(prefix_mix(mix, duration_s, SEED))
    interval = 0.1
    config = dataclasses.replace(_config(routing, duration_s, interval), drain_s=600.0)
    result = VirtualCluster(config, arrivals).run()
    out = score(result, {a.id: a for a in arrivals})
    panic = routing.admission.panic_watermark
    peaks = [max(p.node_kv_usage[i] for p in result.series) for i in range(NODES)]
    idle = [0.0] * NODES
    for p in result.series:
        for i in range(NODES):
            others = sum(p.node_waiting) - p.node_waiting[i] + p.queued
            if p.node_running[i] == 0 and others > 0:
                idle[i] += interval
    out.update(kv_peak=peaks, above_panic=sum(k > panic for k in peaks), idle_while_queued_s=idle)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[1200, 1600])
    parser.add_argument("--hot-rate", type=float, default=150.0, help="requests/s (150)")
    parser.add_argument("--hot-seconds", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="small loads, to try the script")
    parser.add_argument("--routings", nargs="+", default=list(ROUTINGS))
    parser.add_argument("--report", action="store_true", help="only rewrite results.md")
    args = parser.parse_args()
    if args.report:
        report(json.loads((HERE / "results.json").read_text()))
        return
    if args.quick:
        args.conversations, args.hot_rate, args.hot_seconds = [200], 40.0, 10.0
    results: dict[str, Any] = {"chats": {}, "hot": {}}
    for n in args.conversations:
        spec = ChatSpec(conversations=n)
        for name in args.routings:
            t0 = time.perf_counter()
            row = run_chats(ROUTINGS[name], spec)
            results["chats"].setdefault(str(n), {})[name] = row
            print(f"chats {n} {name}: {_brief(row)} ({time.perf_counter() - t0:.0f} s)")
    for name in args.routings:
        row = run_hot(ROUTINGS[name], args.hot_rate, args.hot_seconds)
        results["hot"][name] = row
        print(f"hot {name}: {_brief(row)} kv peak {max(row['kv_peak']):.2f}")
    results["setup"] = {"conversations": args.conversations, "hot_rate_rps": args.hot_rate,
                        "hot_seconds": args.hot_seconds, "nodes": NODES, "seed": SEED}  # fmt: skip
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    _plot(results)
    report(results)
    print(f"wrote {HERE / 'results.json'}, results.md and routing.png")


def report(results: dict[str, Any]) -> None:
    """results.md: one table per load of chats, one for the hot prefix."""
    setup = results["setup"]
    lines = [
        "# Routing by prefix cache, in virtual time",
        "",
        f"{setup['nodes']} `gpu-8b` engines with prefix caching, seed {setup['seed']}; how the",
        "runs are made and scored: the docstring of `run.py` (`python benchmarks/prefix_routing"
        "/run.py`).",
        "",
    ]
    head = ("| routing | output tok/s | TTFT p50 | TTFT p90 | hit rate | ideal | hit / ideal "
            "| preemptions | ok / requests | 429s |")  # fmt: skip
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    for load, rows in results["chats"].items():
        lines += [f"## Multi-turn chats: {load} conversations x 5 turns", "", head, rule]
        lines += [_row(name, row) for name, row in rows.items()]
        lines.append("")
    lines += [
        f"## Hot prefix: 80 % of {setup['hot_rate_rps']:g} requests/s on one prefix, "
        f"{setup['hot_seconds']:g} s",
        "",
        head,
        rule,
        *(_row(name, row) for name, row in results["hot"].items()),
        "",
        "| routing | KV peak per engine | engines above panic | idle while others queue (s) |",
        "| --- | --- | ---: | --- |",
    ]
    for name, row in results["hot"].items():
        peaks = " ".join(f"{k:.2f}" for k in row["kv_peak"])
        idle = " ".join(f"{t:.1f}" for t in row["idle_while_queued_s"])
        lines.append(f"| {name} | {peaks} | {row['above_panic']} | {idle} |")
    lines += ["", *NOTES]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")


NOTES = [
    "## Reading",
    "",
    "- The prefix-blind routings (round-robin, least-loaded, headroom-only) find a",
    "  conversation's history cached only on the engine its previous turn went to, 1 time",
    "  in 8: their hit rate is about 0.55 of the ideal. kvgate's `prefix-aware` routing",
    "  (`kvgate.core.policies.routing`) sends a turn where its prompt is cached unless that",
    "  engine is fuller or has more prefill queued than the prefill it saves: at 1,200",
    "  conversations it reaches 0.99 of the ideal hit rate from the engines' KV events",
    "  (`prefix-aware`) and 0.93 from its own placements alone (`prefix-approx`, an LRU",
    "  model of each engine's cache that misses the answers' blocks).",
    "- Chats are a closed loop (a turn follows the previous answer), so throughput is what",
    "  the users ask for until the engines saturate. Prefill saved is time the engines",
    "  spend decoding: at 1,200 conversations prefix-aware serves 1.35x headroom-only's",
    "  output tokens/s with 0.37x its TTFT p90. At 1,600 (past what the 8 engines serve)",
    "  every routing is bound by capacity; kvgate queues instead of preempting, the cached",
    "  engine is often the full one, and the hit rate falls to 0.76 of the ideal: 1.18x",
    "  headroom-only's throughput, 0.80x its TTFT p90 (which is the wait in the queue).",
    "  Issue 24's target (1.5x, TTFT p90 <= 0.5x) is met at neither load by throughput;",
    "  TTFT p90 meets it at 1,200.",
    "- Both kvgate routings count shared prompt blocks once (`kvgate.core.prefix.held`),",
    "  which headroom-only profits from too (its figures here are with it).",
    "- Hot prefix: prefix-aware concentrates the hot prefix on fewer engines than a blind",
    "  routing (KV peaks in the second table), every engine under panic and none idle while",
    "  others queue. At this load no engine fills (peaks 0.26), so the spread to a second",
    "  engine as the first saturates is shown by the unit test",
    "  (`tests/core/test_routing.py`), not here.",
    "- A turn that fails ends its conversation: the few missing requests of the kvgate",
    "  routings are conversations that stopped there.",
    "- Provenance: the kvgate rows are `run.py --routings headroom-only prefix-aware",
    "  prefix-approx` at commit 80ddb99; the round-robin and least-loaded rows come from",
    "  the run at 0ac4e55 (their placement is unchanged since, and a rerun here gave the",
    "  same chat figures to the token). prefix-aware at 1,200 conversations, rerun at",
    "  b9201e0 (the final ledger), gave the same figures to the token.",
]


def _row(name: str, r: dict[str, Any]) -> str:
    return (
        f"| {name} | {r['output_tok_per_s']:,.0f} | {r['ttft_p50_s']:.3f} | "
        f"{r['ttft_p90_s']:.3f} | {r['hit_rate']:.1%} | {r['ideal_hit_rate']:.1%} | "
        f"{r['hit_vs_ideal']:.2f} | {r['preemptions']} | {r['ok']} / {r['requests']} | "
        f"{r['refused_429']} |"
    )


def _brief(row: dict[str, Any]) -> str:
    return (
        f"{row['output_tok_per_s']:.0f} tok/s, TTFT p90 {row['ttft_p90_s']:.2f} s, "
        f"hits {row['hit_rate']:.0%} of ideal {row['ideal_hit_rate']:.0%}, "
        f"{row['preemptions']} preemptions, {row['ok']}/{row['requests']} ok"
    )


def _plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(results["chats"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    metrics = (("output_tok_per_s", "output tokens/s"), ("ttft_p90_s", "TTFT p90 (s)"),
               ("hit_vs_ideal", "hit rate / ideal"))  # fmt: skip
    for ax, (key, label) in zip(axes, metrics, strict=True):
        names = list(results["chats"][loads[0]])
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs = [i + j * width for i in range(len(loads))]
            ax.bar(xs, [results["chats"][n][name][key] for n in loads], width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))])
        ax.set_xticklabels([f"{n} chats" for n in loads])
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle(f"multi-turn chats on {NODES} gpu-8b engines with prefix caching")
    fig.tight_layout()
    fig.savefig(HERE / "routing.png", dpi=110)


if __name__ == "__main__":
    main()
