"""Before/after: run `speed.py` on two versions of kvgate's source, side by side.

    git worktree add --detach /tmp/kvgate-before <old commit>
    python benchmarks/sim_speed/compare.py --before-src /tmp/kvgate-before/src \\
        --sim-seconds 300 --rounds 1
    git worktree remove /tmp/kvgate-before

Each scenario is run by a fresh interpreter per version, alternating before / after, so
both sides see the same machine load; with `--rounds 2` or more the table keeps each
side's fastest round (the least disturbed by other work on a shared machine). CPU time
(`time.process_time`) is what is compared. The fingerprint of every try's record must be
the same on both sides: the faster code has then simulated exactly the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AFTER_SRC = HERE.parent.parent / "src"


def run_side(src: Path, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    """One `speed.py` run of one scenario against the package under `src`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.jsonl"
        command = [
            sys.executable,
            str(HERE / "speed.py"),
            "--sim-seconds", str(args.sim_seconds),
            "--profile-seconds", "0",
            "--scenario", scenario,
            "--overload", str(args.overload),
            "--scrape-interval", str(args.scrape_interval),
            "--out", str(Path(tmp) / "table"),
            "--json", str(out),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(src)}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before-src", required=True, type=Path)
    parser.add_argument("--after-src", type=Path, default=AFTER_SRC)
    parser.add_argument("--sim-seconds", type=float, default=300.0)
    parser.add_argument("--scenario", nargs="+", default=["engines", "none", "adaptive"])
    parser.add_argument("--overload", type=float, default=3.0)
    parser.add_argument("--scrape-interval", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "compare.md.table"))
    parser.add_argument("--rows", help="also write every run's row (JSON) to this file")
    args = parser.parse_args()
    lines = [
        "| scenario | simulated | CPU before | CPU after | speed-up | CPU per simulated hour"
        " before / after | client requests (tries) | CPU per try before / after"
        " | same runs (fingerprint) | load avg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    rows: list[dict[str, Any]] = []
    for name in args.scenario:
        before: list[dict[str, Any]] = []
        after: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            before.append(run_side(args.before_src, name, args))
            after.append(run_side(args.after_src, name, args))
            print(name, before[-1]["cpu_s"], after[-1]["cpu_s"], flush=True)
        rows += [{"side": "before", **r} for r in before] + [{"side": "after", **r} for r in after]
        b = min(before, key=lambda r: r["cpu_s"])
        a = min(after, key=lambda r: r["cpu_s"])
        same = {r["fingerprint"] for r in before + after}
        load = sum(r["load"] for r in before + after) / (2 * args.rounds)
        lines.append(
            f"| {a['scenario']} | {a['sim_s']:.0f} s | {b['cpu_s']:.1f} s | {a['cpu_s']:.1f} s"
            f" | {b['cpu_s'] / a['cpu_s']:.2f}x | {b['cpu_per_sim_hour_s']:.0f} s /"
            f" {a['cpu_per_sim_hour_s']:.0f} s | {a['requests']:,} ({a['tries']:,}) |"
            f" {1e6 * b['cpu_s'] / b['tries']:.0f} us / {1e6 * a['cpu_s'] / a['tries']:.0f} us |"
            f" {'yes' if len(same) == 1 else 'NO: ' + ', '.join(sorted(same))} | {load:.1f} |"
        )
    if args.rows:
        Path(args.rows).write_text(json.dumps(rows, indent=1) + "\n")
    table = "\n".join(lines)
    print(table)
    Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
