"""The prefix index across gateway replicas, in virtual time (issue 24, "Replicas").

The chats of `benchmarks/prefix_routing` (`kvgate.bench.prefix`: 8 `gpu-8b` engines with
prefix caching, seed 1; a closed loop of multi-turn conversations, 5 turns each) go through
1, 2 and 3 replicas of kvgate (`prefix-aware` routing, its queue), each attempt to the next
replica in turn, so a conversation's turns land on replicas at random. Replicas exchange
their views through a modelled store every 50 ms (`SYNC_PERIOD_S`, 0.5 ms each way), as on
one Redis. Each replica's prefix index comes from one of:

- `precise`: it subscribes to every engine's KV events itself (the ZMQ fan-out);
- `views`: the events of each engine reach its owner (replica `node % replicas`) only, and
  the others through the owner's view, one to two sync intervals later
  (`kvgate.sim.kv_fanout`): what sharing the owner's index through the views would give;
- `approximate`: only its own placements (no events).

`headroom-only` (one replica) is the prefix-blind floor. Scored as `kvgate.bench.prefix`
scores (throughput, TTFT p90, hit rate against the ideal, preemptions), plus how often a
conversation's next turn, whose prompt extends the previous turn's prompt and answer
(cached where that turn ran), goes to another engine than that turn: `moved across` when
the two turns were placed by different replicas (two replicas sending the same prefix to
different engines), `moved within` when by the same one.

The 1-replica `precise` run also measures the event stream (`kvgate.bench.kv_stream`): per
engine and second, batches, block hashes stored and removed and bytes on the wire; what a
view would carry per sync (the net change of an engine's cached blocks per 50 ms); and, by
a micro-benchmark on one engine's recorded stream, the CPU a subscriber spends per batch
(`decode_batch` + the tracker) against a view reader's per delta.

    python benchmarks/prefix_replicas/run.py [--conversations 1200] [--long 500] [--quick]
    python benchmarks/prefix_replicas/run.py --report   # results.md from results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from kvgate.bench.kv_stream import StreamMeter, decode_cost
from kvgate.bench.prefix import (
    ROUTINGS,
    Traffic,
    brief,
    caching,
    chats,
    configure,
    scored,
    turn_moves,
)
from kvgate.cluster.sync import SYNC_PERIOD_S
from kvgate.sim.prefix_workloads import ChatSpec
from kvgate.sim.virtual import VirtualCluster

HERE = Path(__file__).resolve().parent
ENGINE = caching("gpu-8b")
NODES = 8
SEED = 1
STORE_LATENCY_S = 0.001
#: Index source -> (routing of `kvgate.bench.prefix.ROUTINGS`, how events reach replicas).
SOURCES = {
    "precise": ("prefix-aware", "subscribe"),
    "views": ("prefix-aware", "views"),
    "approximate": ("prefix-approx", "subscribe"),
}
REPLICAS = (1, 2, 3)
#: (source, replicas) of each run; with one replica `views` is `precise` (it owns every engine).
RUNS = [(s, n) for s in SOURCES for n in REPLICAS if (s, n) != ("views", 1)]
#: Where a run stops (virtual seconds): long after the last answer (about 60 s), short
#: enough that the replicas' syncs and scrapes of the idle cluster do not take the time.
HORIZON_S = 300.0


def run_one(
    load: Traffic, source: str, replicas: int, meter: StreamMeter | None = None
) -> dict[str, Any]:
    routing_name, via = SOURCES.get(source, (source, "subscribe"))
    routing = ROUTINGS[routing_name]
    config = configure(routing, load, ENGINE, NODES, SEED, series_s=1.0)
    config = dataclasses.replace(
        config,
        duration_s=HORIZON_S,
        gateways=replicas,
        sync_interval_s=SYNC_PERIOD_S if replicas > 1 else None,
        store_latency_s=STORE_LATENCY_S,
        kv_events_via=via,  # type: ignore[arg-type]
    )
    result = VirtualCluster(config, load.arrivals, load.follow_ups, kv_sink=meter).run()
    out = scored(result, load, routing)
    out.update(turn_moves(result))
    out["replicas"] = replicas
    return out


def measure_stream(meter: StreamMeter) -> dict[str, Any]:
    """The stream's figures, and the CPU of its busiest engine's batches both ways."""
    meter.finish()
    stream = meter.summary()
    busiest = stream["timed_engine"] = meter.busiest()
    deltas = meter.delta_texts.get(busiest, [])
    stream.update(decode_cost(meter.payloads[busiest], deltas, ENGINE.num_blocks))
    return stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=1200)
    parser.add_argument("--long", type=int, default=500, help="prefill-heavy chats (500)")
    parser.add_argument("--quick", action="store_true", help="small loads, to try the script")
    parser.add_argument("--report", action="store_true", help="only redraw results.md")
    args = parser.parse_args()
    if args.report:
        report(json.loads((HERE / "results.json").read_text()))
        return
    if args.quick:
        args.conversations, args.long = 200, 100
    specs = {
        f"{args.conversations} chats, 200 in / 300 out": ChatSpec(conversations=args.conversations),
        f"{args.long} chats, 1000 in / 100 out": ChatSpec(
            conversations=args.long, user_tokens=1000, output_tokens=100
        ),
    }
    results: dict[str, Any] = {"runs": {}, "stream": {}}
    for key, spec in specs.items():
        rows = results["runs"][key] = {}
        r = run_one(chats(spec, SEED), "headroom-only", 1)
        rows["headroom-only x1"] = r
        print(f"{key} headroom-only x1: {brief(r)}")
        for source, n in RUNS:
            meter = StreamMeter(SYNC_PERIOD_S) if (source, n) == ("precise", 1) else None
            t0 = time.perf_counter()
            r = rows[f"{source} x{n}"] = run_one(chats(spec, SEED), source, n, meter)
            print(f"{key} {source} x{n}: {brief(r)}, moved across {r['moved_across']:.1%} "
                  f"within {r['moved_within']:.1%} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            if meter is not None:
                results["stream"][key] = stream = measure_stream(meter)
                print(json.dumps(stream, indent=1))
    results["setup"] = {"nodes": NODES, "seed": SEED, "sync_interval_s": SYNC_PERIOD_S,
                        "store_latency_s": STORE_LATENCY_S}  # fmt: skip
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    report(results)
    print(f"wrote {HERE / 'results.json'} and results.md")


HEAD = ("| replicas | index | output tok/s | TTFT p90 | hit rate | hit / ideal | preemptions "
        "| moved across replicas | moved within one | ok / requests |")  # fmt: skip
RULE = "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"


def _row(name: str, r: dict[str, Any]) -> str:
    source, _, n = name.rpartition(" x")
    across = f"{r['moved_across']:.1%} of {r['pairs_across']}" if r["pairs_across"] else "-"
    return (
        f"| {n} | {source} | {r['output_tok_per_s']:,.0f} | {r['ttft_p90_s']:.3f} | "
        f"{r['hit_rate']:.1%} | {r['hit_vs_ideal']:.2f} | {r['preemptions']} | {across} | "
        f"{r['moved_within']:.1%} of {r['pairs_within']} | {r['ok']} / {r['requests']} |"
    )


def _stream_lines(key: str, s: dict[str, Any]) -> list[str]:
    engines = s["engines"]
    cpu_ms = s["subscribe_us_per_batch"] * s["batches_per_s"] / 1000
    view_cpu_ms = s["view_us_per_delta"] / s["sync_interval_s"] / 1000  # a delta every sync
    return [
        f"### {key}",
        "",
        "| per engine | mean |",
        "| --- | ---: |",
        f"| batches/s | {s['batches_per_s']:,.0f} |",
        f"| events/s | {s['events_per_s']:,.0f} |",
        f"| block hashes stored/s | {s['stored_hashes_per_s']:,.0f} |",
        f"| block hashes removed/s | {s['removed_hashes_per_s']:,.0f} |",
        f"| stream bytes/s (wire) | {s['bytes_per_s'] / 1e3:,.0f} kB |",
        f"| stream bytes per stored block | {s['bytes_per_stored_block']:,.0f} |",
        f"| view delta per {s['sync_interval_s'] * 1000:g} ms sync: hashes (mean / p99 / max) "
        f"| {s['delta_hashes_mean']:,.0f} / {s['delta_hashes_p99']:,.0f} / "
        f"{s['delta_hashes_max']:,.0f} |",
        f"| view delta JSON bytes (mean / p99) | {s['delta_json_bytes_mean'] / 1e3:,.1f} kB / "
        f"{s['delta_json_bytes_p99'] / 1e3:,.1f} kB |",
        f"| subscriber CPU: decode + apply per batch | {s['decode_us_per_batch']:,.0f} + "
        f"{s['apply_us_per_batch']:,.0f} µs |",
        f"| subscriber CPU per stored block | {s['subscribe_us_per_stored_block']:.2f} µs |",
        f"| subscriber CPU per second of stream | {cpu_ms:,.1f} ms "
        f"({cpu_ms * engines:,.0f} ms/s for {engines} engines) |",
        f"| view reader CPU per delta (JSON + index) | {s['view_us_per_delta']:,.0f} µs "
        f"(at most {view_cpu_ms:,.1f} ms/s; {view_cpu_ms * engines:,.0f} ms/s for {engines}) |",
        "",
    ]


def report(results: dict[str, Any]) -> None:
    setup = results["setup"]
    lines = [
        "# The prefix index across gateway replicas, in virtual time",
        "",
        f"{setup['nodes']} `gpu-8b` engines with prefix caching, seed {setup['seed']}; replicas "
        f"sync every {setup['sync_interval_s'] * 1000:g} ms through a store "
        f"{setup['store_latency_s'] * 1000:g} ms away. How the runs are made and scored: the "
        "docstring of `run.py` (`python benchmarks/prefix_replicas/run.py`).",
        "",
    ]
    for key, rows in results["runs"].items():
        lines += [f"## Multi-turn chats: {key} per turn, 5 turns", "", HEAD, RULE]
        lines += [_row(name, r) for name, r in rows.items()]
        lines.append("")
    lines += ["## The event stream and its two ways to the replicas", ""]
    for key, s in results["stream"].items():
        lines += _stream_lines(key, s)
    lines += NOTES
    (HERE / "results.md").write_text("\n".join(lines) + "\n")


NOTES = [
    "## Reading",
    "",
    "- **Subscribed replicas route as one.** With every replica subscribed to every engine's",
    "  events (`precise`), 2 and 3 replicas reach one replica's hit rate (0.99-1.00 of the",
    "  ideal on the chats, 0.96-0.97 against 0.92 on the prefill-heavy chats) and its",
    "  throughput, and a conversation's next turn leaves the engine caching its history as",
    "  rarely when another replica places it as when the same one does (0.3-2.3 % on the",
    "  chats; 7-10 % on the prefill-heavy ones, where an engine fills and the turn goes",
    "  to a second one, by either replica alike). Every replica reads the same stream, so",
    "  the indexes agree up to each replica's own placements of the last instants.",
    "- **Approximate replicas do not.** A replica that knows only its own placements does",
    "  not know where another replica sent a conversation's last turn: 88-91 % of the turns",
    "  placed by another replica than the previous turn move engine; the hit rate falls to",
    "  0.74 / 0.68 of the ideal with 2 / 3 replicas (chats; 0.67 / 0.60 prefill-heavy), and",
    "  throughput loses two thirds or more of what prefix routing gains over headroom-only.",
    "- **Through the views.** Sharing the owner's index through the views (`views`: the",
    "  owner subscribes, the others learn its engines' changes at their first exchange after",
    "  the owner's next sync: 26-76 ms late with 2 replicas, 18-93 ms with 3, 51 ms on",
    "  average at a 50 ms sync and a 1 ms store) scores as subscribing does here: a turn",
    "  follows its answer by a think time (1 s on average), and its history's blocks were",
    "  stored when its previous turn was prefilled.",
    "- **Cost.** One engine's stream is 29-51 kB/s on the wire (about 70 bytes per stored",
    "  block: the token ids dominate) and 16-21 batches/s; a subscriber spends 38-78 µs per",
    "  batch (msgpack decode, then the tracker rehashes the stored blocks' token ids into",
    "  kvgate's hashes), 0.8-1.2 ms of CPU per engine per second, about 1 % of a core per",
    "  replica for these 8 engines. A view would carry per engine and sync a net delta of",
    "  23-45 block hashes on average (p99 94-275, 0.5-0.9 kB of JSON, p99 5.6 kB), and a",
    "  reader spends 18-34 µs on each (JSON and index): it saves a replica about half of its",
    "  subscriber CPU (a few ms/s at 8 engines), and adds the staleness above, store traffic,",
    "  and the owner as a dependency (see docs/flow-control.md, the prefix index's replicas).",
]


if __name__ == "__main__":
    main()
