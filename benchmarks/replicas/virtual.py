"""Gateway replicas in virtual time: independent books against one shared state.

A burst on four `gpu-8b` engines (2 s at 120 requests/s, then 8 s at 12 requests/s;
6,000-token prompts, 600 output tokens, ignore_eos) goes through 1, 2, 4 and 8 replicas of
kvgate's admission (the `adaptive` policy with its queue), requests spread round-robin
over the replicas. Each configuration runs twice:

- `independent`: every replica knows only its own requests (and the shared samples);
- `shared`: replicas exchange their views through a store every 20 ms, views visible 1 ms
  after they are written (kvgate.core.peers: every replica plans every request's peak, and
  each fills only its share of a node's slack between two syncs).

Writes `results.md` (peak KV, preemptions, goodput against one replica's) and
`peak_and_goodput.png` next to this file.

    python benchmarks/replicas/virtual.py [--seeds 1,2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvgate.core.settings import AdmissionSettings
from kvgate.sim.presets import get_preset
from kvgate.sim.virtual import VirtualCluster, VirtualConfig
from kvgate.sim.workload import Phase, WorkloadSpec

HERE = Path(__file__).resolve().parent
REPLICAS = (1, 2, 4, 8)
SYNC_S = 0.02
LATENCY_S = 0.001


def run(replicas: int, shared: bool, seed: int) -> dict[str, float]:
    workload = WorkloadSpec(
        phases=(Phase(2.0, 120.0), Phase(8.0, 12.0)),
        prompt_mean=6000,
        prompt_sigma=0.05,
        max_tokens_mean=600,
        max_tokens_sigma=0.3,
        ignore_eos_fraction=1.0,
        priority_weights=(0, 1, 0),
    )
    config = VirtualConfig(
        engine=get_preset("gpu-8b"),
        workload=workload,
        duration_s=10.0,
        nodes=4,
        gateways=replicas,
        admission=AdmissionSettings(policy="adaptive", seed=seed),
        drain_s=60.0,
        seed=seed,
        sync_interval_s=SYNC_S if shared else None,
        store_latency_s=LATENCY_S,
    )
    result = VirtualCluster(config).run()
    summary = result.summary()
    return {
        "peak_kv": max(p.kv_usage_max for p in result.series),
        "goodput": summary["goodput_tokens_per_s"],
        "preemptions": summary["preemptions"],
        "ok": summary["by_status"].get("ok", 0),
        "requests": summary["requests"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for mode in ("independent", "shared"):
        for n in REPLICAS:
            runs = [run(n, mode == "shared", seed) for seed in seeds]
            rows[mode, n] = {k: mean(r[k] for r in runs) for k in runs[0]}
            print(mode, n, rows[mode, n], flush=True)
    one = rows["shared", 1]["goodput"]
    lines = [
        "# Replicas in virtual time: independent books against one shared state",
        "",
        f"Command: `python benchmarks/replicas/virtual.py --seeds {args.seeds}` "
        f"(mean over seeds {seeds}). Four `gpu-8b` engines; a burst of 2 s at 120 req/s then "
        "8 s at 12 req/s, 6,000-token prompts, 600 output tokens (ignore_eos); `adaptive` "
        f"with its queue; `shared`: views exchanged every {SYNC_S * 1000:.0f} ms, visible "
        f"{LATENCY_S * 1000:.0f} ms after they are written. Panic watermark 0.92.",
        "",
        "| replicas | books | peak KV | preemptions | goodput tok/s | vs one replica | served |",
        "|---|---|---|---|---|---|---|",
    ]
    for (mode, n), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(
            f"| {n} | {mode} | {r['peak_kv']:.3f} | {r['preemptions']:.0f} | "
            f"{r['goodput']:,.0f} | {r['goodput'] / one:.1%} | "
            f"{r['ok']:.0f} / {r['requests']:.0f} |"
        )
    lines += ["", "![peak KV and goodput against the number of replicas](peak_and_goodput.png)"]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("independent", "o--"), ("shared", "s-")):
        ax1.plot(REPLICAS, [rows[mode, n]["peak_kv"] for n in REPLICAS], style, label=mode)
        ax2.plot(REPLICAS, [rows[mode, n]["goodput"] / one for n in REPLICAS], style, label=mode)
    ax1.axhline(0.92, color="red", lw=0.8, label="panic watermark")
    ax1.set(xlabel="replicas", ylabel="peak KV usage (fullest engine)", xticks=REPLICAS)
    ax2.set(xlabel="replicas", ylabel="goodput / one replica's", xticks=REPLICAS)
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(HERE / "peak_and_goodput.png", dpi=110)


if __name__ == "__main__":
    main()
