"""Gateway replicas in virtual time: independent books against one shared state.

Two bursts go through 1, 2, 4 and 8 replicas of kvgate's admission (the `adaptive` policy
with its queue), requests spread round-robin over the replicas:

- `gpu-8b`: four `gpu-8b` engines; 2 s at 120 requests/s, then 8 s at 12 requests/s;
  6,000-token prompts, 600 output tokens (ignore_eos);
- `cpu-tiny`: four `cpu-tiny` engines (4,096 KV tokens: one request is a fifth of an
  engine, so a race for the last room matters); 2 s at 20 requests/s, then 6 s at 3.3/s;
  ~800-token prompts, 300 output tokens (ignore_eos): the live benchmark's burst.

Each configuration runs twice:

- `independent`: every replica knows only its own requests (and the shared samples);
- `shared`: replicas exchange their views through a store every 50 ms (the sync period),
  one atomic exchange 0.5 ms away each way (kvgate.core.replicas.peers: every replica plans every
  request's peak, and adds requests only within its claim on a node's slack).

Writes the virtual-time part of `results.md` (peak KV, preemptions, goodput against one
replica's; the live part, written by live.py, is kept) and `peak_and_goodput.png`.

    python benchmarks/replicas/virtual.py [--seeds 1,2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvgate.cluster.sync import SYNC_PERIOD_S
from kvgate.sim.presets import get_preset
from kvgate.sim.runs import VirtualConfig
from kvgate.sim.virtual import VirtualCluster
from kvgate.sim.workload import Phase, WorkloadSpec

HERE = Path(__file__).resolve().parent
REPLICAS = (1, 2, 4, 8)
LATENCY_S = 0.001
SCENARIOS = {
    "gpu-8b": WorkloadSpec(
        phases=(Phase(2.0, 120.0), Phase(8.0, 12.0)),
        prompt_mean=6000,
        prompt_sigma=0.05,
        max_tokens_mean=600,
        max_tokens_sigma=0.3,
        ignore_eos_fraction=1.0,
        priority_weights=(0, 1, 0),
    ),
    "cpu-tiny": WorkloadSpec(
        phases=(Phase(2.0, 20.0), Phase(6.0, 20.0 / 6)),
        prompt_mean=800,
        prompt_sigma=0.05,
        max_tokens_mean=300,
        max_tokens_sigma=0.0,
        ignore_eos_fraction=1.0,
        priority_weights=(0, 1, 0),
    ),
}


def run(engine: str, replicas: int, shared: bool, seed: int) -> dict[str, float]:
    workload = SCENARIOS[engine]
    config = VirtualConfig(
        engine=get_preset(engine),
        workload=workload,
        duration_s=sum(p.duration_s for p in workload.phases),
        nodes=4,
        gateways=replicas,
        policy="adaptive",
        drain_s=60.0,
        seed=seed,
        sync_interval_s=SYNC_PERIOD_S if shared else None,
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
    rows: dict[tuple[str, str, int], dict[str, float]] = {}
    for engine in SCENARIOS:
        for mode in ("independent", "shared"):
            for n in REPLICAS:
                runs = [run(engine, n, mode == "shared", seed) for seed in seeds]
                rows[engine, mode, n] = {k: mean(r[k] for r in runs) for k in runs[0]}
                print(engine, mode, n, rows[engine, mode, n], flush=True)
    lines = [
        "# Replicas in virtual time: independent books against one shared state",
        "",
        f"Command: `python benchmarks/replicas/virtual.py --seeds {args.seeds}` "
        f"(mean over seeds {seeds}). `adaptive` with its queue; `shared`: views exchanged "
        f"every {SYNC_PERIOD_S * 1000:.0f} ms in one atomic exchange "
        f"{LATENCY_S * 500:.1f} ms away each way. Panic watermark 0.92. "
        "`gpu-8b`: four `gpu-8b` engines, a burst of 2 s at 120 req/s then 8 s at 12 req/s, "
        "6,000-token prompts, 600 output tokens (ignore_eos). `cpu-tiny`: four `cpu-tiny` "
        "engines (4,096 KV tokens), 2 s at 20 req/s then 6 s at 3.3 req/s, ~800-token "
        "prompts, 300 output tokens (ignore_eos), the live benchmark's burst.",
        "",
        "| engines | replicas | books | peak KV | preemptions | goodput tok/s "
        "| vs one replica | served |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (engine, mode, n), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        one = rows[engine, "shared", 1]["goodput"]
        lines.append(
            f"| {engine} | {n} | {mode} | {r['peak_kv']:.3f} | {r['preemptions']:.0f} | "
            f"{r['goodput']:,.0f} | {r['goodput'] / one:.1%} | "
            f"{r['ok']:.0f} / {r['requests']:.0f} |"
        )
    lines += ["", "![peak KV and goodput against the number of replicas](peak_and_goodput.png)", ""]
    path = HERE / "results.md"
    old = path.read_text() if path.exists() else ""
    live = old[old.index("## Live") :] if "## Live" in old else ""
    path.write_text("\n".join(lines) + ("\n" + live if live else ""))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for engine, marker in (("gpu-8b", "o"), ("cpu-tiny", "s")):
        for mode, line in (("independent", "--"), ("shared", "-")):
            label = f"{engine}, {mode}"
            peak = [rows[engine, mode, n]["peak_kv"] for n in REPLICAS]
            one = rows[engine, "shared", 1]["goodput"]
            good = [rows[engine, mode, n]["goodput"] / one for n in REPLICAS]
            axes[0].plot(REPLICAS, peak, marker + line, label=label)
            axes[1].plot(REPLICAS, good, marker + line, label=label)
    axes[0].axhline(0.92, color="red", lw=0.8, label="panic watermark")
    axes[0].set(xlabel="replicas", ylabel="peak KV usage (fullest engine)", xticks=REPLICAS)
    axes[1].set(xlabel="replicas", ylabel="goodput / one replica's", xticks=REPLICAS)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "peak_and_goodput.png", dpi=110)


if __name__ == "__main__":
    main()
