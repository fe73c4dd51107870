"""How much the live dashboard costs, in the browser and in the gateway, by cluster size.

For 8, 64 and 128 synthetic nodes (the gateway's exact `/admin/state` shape, served by the
real dashboard routes on uvicorn) it opens /dashboard in headless Chromium for a while,
with an overload and a stale node, and records:

- per-frame render time in the page (DOM updates of every node row + 6 charts), from the
  page's own `kvgate.renderMs`;
- updates received vs frames rendered (does rendering keep pace with 5 updates/s?);
- the server's cost of one SSE frame (JSON encoding of the snapshot), timed in-process.

    python benchmarks/dashboard/run.py            # writes results.md next to this file

Numbers depend on the machine; results.md says which one and how loaded it was.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "operator"))

from opview_browser import missing_reason, page  # noqa: E402
from opview_synthetic import SyntheticCluster, router, serve  # noqa: E402

from kvgate.gateway.ops.dashboard import encode_event  # noqa: E402

SIZES = (8, 64, 128)
SECONDS = 20.0


def encode_cost_us(nodes: int, rounds: int = 200) -> float:
    cluster = SyntheticCluster(nodes)
    state = cluster.state()
    started = time.perf_counter()
    for _ in range(rounds):
        encode_event(state)
    return (time.perf_counter() - started) / rounds * 1e6


def frame_bytes(nodes: int) -> int:
    return len(encode_event(SyntheticCluster(nodes).state()))


def browser_run(nodes: int) -> dict[str, float]:
    cluster = SyntheticCluster(nodes)
    with serve(router(cluster.state)) as url, page() as p:
        p.goto(url + "/dashboard")
        p.wait_for_function("window.kvgate && kvgate.updates >= 3", timeout=30_000)
        p.wait_for_timeout(int(SECONDS * 500))
        cluster.overload = True
        cluster.stale.add(cluster.ids[1])
        p.wait_for_timeout(int(SECONDS * 500))
        data = p.evaluate(
            "({u: kvgate.updates, r: kvgate.renders, ms: kvgate.renderMs.slice(),"
            " heap: (performance.memory || {}).usedJSHeapSize || 0})"
        )
    ms = sorted(data["ms"])
    return {
        "updates": data["u"],
        "renders": data["r"],
        "mean_ms": statistics.fmean(ms),
        "p50_ms": ms[len(ms) // 2],
        "p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "max_ms": ms[-1],
        "heap_mb": data["heap"] / 1e6,
    }


def main() -> int:
    reason = missing_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    load = os.getloadavg()[0]
    rows = []
    for nodes in SIZES:
        result = browser_run(nodes)
        rows.append(
            f"| {nodes} | {result['updates']} | {result['renders']} | {result['mean_ms']:.2f} |"
            f" {result['p50_ms']:.2f} | {result['p99_ms']:.2f} | {result['max_ms']:.2f} |"
            f" {result['heap_mb']:.1f} | {frame_bytes(nodes) / 1024:.1f} |"
            f" {encode_cost_us(nodes):.0f} |"
        )
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Dashboard cost by cluster size",
            "",
            f"`python benchmarks/dashboard/run.py`, {SECONDS:.0f} s per size (half calm, half"
            " overloaded with one stale node), 5 updates/s, 1600x1300 viewport, headless"
            f" Chromium; {platform.machine()}, {os.cpu_count()} cores, load average"
            f" {load:.1f} at the start (other work was running).",
            "",
            "| nodes | updates received | frames rendered | render mean ms | p50 ms | p99 ms |"
            " max ms | JS heap MB | SSE frame KiB | server encode µs/frame |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "A frame redraws the six uPlot charts and the node states; node numbers, bars and"
            " sparklines refresh at 2.5 Hz for rows on or near the screen and every ~2 s for"
            " the others (text and styles written only when they changed). At 5 updates per"
            " second the page has 200 ms per update; frames rendered ≈ updates received means"
            " rendering keeps pace (the browser coalesces updates that arrive within one frame).",
            "",
        ]
    )
    (HERE / "results.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
