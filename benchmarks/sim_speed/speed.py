"""How fast does the virtual-time mode run? (target: 1 simulated hour, 16 nodes, 3x
overload, in under a minute of wall time on one core)

    python benchmarks/sim_speed/speed.py --sim-seconds 3600 --scenario all

Scenarios (all: `gpu-8b` engines, the workload below at 3x the cluster's estimated
capacity, clients with a 30 s timeout, 2 retries, up to 5 tries on 429):

- `engines`: admission `none`, no scrapes: the simulator alone (engines, clients, events).
- `none`: admission `none` with 50 ms scrapes with 10 ms lag (policy bookkeeping included).
- `adaptive`: kvgate's policy, 50 ms scrapes: the real use.

Both wall and CPU time of this process are recorded: on a shared machine the CPU time is
what "on one core" means. A profiled run of each (shorter; `--profile-seconds 0` skips it)
splits the time between the simulator (`kvgate.sim`) and the admission core (`kvgate.core`).
Each row carries a fingerprint of every try's record, so runs of two versions of the code
can be shown to have simulated exactly the same thing (`compare.py`). Results: results.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import json
import math
import os
import pstats
import time
from pathlib import Path

from kvgate.sim.presets import GPU_8B
from kvgate.sim.runs import VirtualConfig, VirtualResult, read_timeout_client
from kvgate.sim.virtual import run_virtual
from kvgate.sim.workload import WorkloadSpec, estimate_capacity_rps

HERE = Path(__file__).resolve().parent
WORKLOAD = WorkloadSpec(prompt_mean=1000, max_tokens_mean=400, ignore_eos_fraction=0.2)


def scenario(
    name: str, seconds: float, nodes: int, overload: float = 3.0, scrape_s: float = 0.05
) -> VirtualConfig:
    rate = overload * estimate_capacity_rps(GPU_8B, WORKLOAD, nodes)
    policy = "none" if name in ("engines", "none") else name
    return VirtualConfig(
        engine=GPU_8B,
        workload=dataclasses.replace(WORKLOAD, rate_rps=rate),
        duration_s=seconds,
        nodes=nodes,
        policy=policy,  # type: ignore[arg-type]
        scrape_interval_s=1e9 if name == "engines" else scrape_s,
        client=read_timeout_client(timeout_s=30.0),
        seed=1,
    )


def fingerprint(result: VirtualResult) -> str:
    """A digest of every try of every request (times, outcome, node, tokens, Retry-After)."""
    digest = hashlib.sha256()
    for o in result.outcomes:
        tries = [
            (a.start, a.end, a.outcome, a.node, a.retry_after_s, a.output_tokens, a.first_token_at)
            for a in o.tries
        ]
        digest.update(repr((o.status, o.output_tokens, o.completed_at, tries)).encode())
    return digest.hexdigest()[:16]


def split(profile: cProfile.Profile) -> dict[str, float]:
    """Share of profiled self-time per package."""
    stats = pstats.Stats(profile)
    shares = {"kvgate.sim": 0.0, "kvgate.core": 0.0, "other": 0.0}
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/kvgate/sim/" in filename:
            shares["kvgate.sim"] += tottime
        elif "/kvgate/core/" in filename:
            shares["kvgate.core"] += tottime
        else:
            shares["other"] += tottime
    total = sum(shares.values()) or 1.0
    return {k: 100.0 * v / total for k, v in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sim-seconds", type=float, default=3600.0)
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--scenario", nargs="+", default=["engines", "none", "adaptive"])
    parser.add_argument("--overload", type=float, default=3.0, help="load / capacity")
    parser.add_argument("--scrape-interval", type=float, default=0.05, help="seconds (0.05)")
    parser.add_argument("--out", default=str(HERE / "results.md.table"))
    parser.add_argument("--json", help="also append each row as a JSON line to this file")
    args = parser.parse_args()
    rows = []
    for name in args.scenario:
        cfg = scenario(name, args.sim_seconds, args.nodes, args.overload, args.scrape_interval)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = run_virtual(cfg)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        summary = result.summary()
        shares = {"kvgate.sim": math.nan, "kvgate.core": math.nan, "other": math.nan}
        if args.profile_seconds > 0:
            profile = cProfile.Profile()
            profile.runcall(
                run_virtual,
                scenario(
                    name, args.profile_seconds, args.nodes, args.overload, args.scrape_interval
                ),
            )
            shares = split(profile)
        row = {
            "scenario": f"{name} at {args.overload:g}x, scrape {args.scrape_interval:g} s",
            "sim_s": args.sim_seconds,
            "wall_s": wall,
            "cpu_s": cpu,
            "x_real_time": args.sim_seconds / wall,
            "cpu_per_sim_hour_s": cpu * 3600.0 / args.sim_seconds,
            "events": result.events,
            "requests": summary["requests"],
            "tries": sum(len(o.tries) for o in result.outcomes),
            "ok": summary["by_status"].get("ok", 0),
            "engine_steps": summary["engine_steps"],
            "load": os.getloadavg()[0],
            "fingerprint": fingerprint(result),
            **{f"share_{k}": v for k, v in shares.items()},
        }
        print(row, flush=True)
        rows.append(row)
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps({"name": name, **row}) + "\n")
    lines = [
        "| scenario | simulated | wall | CPU | CPU per simulated hour | events | "
        "requests (ok) | engine steps | time in kvgate.sim / kvgate.core / other | load avg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['sim_s']:.0f} s | {r['wall_s']:.1f} s | {r['cpu_s']:.1f} s | "
            f"{r['cpu_per_sim_hour_s']:.0f} s | {r['events']:,} | "
            f"{r['requests']:,} ({r['ok']:,}) | {r['engine_steps']:,} | "
            f"{r['share_kvgate.sim']:.0f} % / {r['share_kvgate.core']:.0f} % / "
            f"{r['share_other']:.0f} % | {r['load']:.1f} |"
        )
    table = "\n".join(lines)
    print(table)
    Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
