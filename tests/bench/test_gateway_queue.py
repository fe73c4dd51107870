"""The live benchmark reports kvgate's queue: what waited, how many, and how long.

A real gateway (adaptive policy) in front of the fake engine on 127.0.0.1 gets a burst
larger than the engine's room; the load generator must find the burst in kvgate's queue
(the `queued` series), and its account of the run (`extra["gateway_queue"]`) must agree
with the gateway's own counters. The histogram arithmetic is checked by hand.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway.helpers import until_ready

from kvgate.bench.gateway_queue import WaitHistogram, queue_summary, wait_histogram
from kvgate.bench.live.client import LiveTarget
from kvgate.bench.live.run import LiveOptions, run_live
from kvgate.bench.metrics import OK, Attempt, EngineTotals, RunResult, Slo, UserRequest
from kvgate.bench.metrics import queue_figures as figures
from kvgate.bench.report import ReportMeta, write_report
from kvgate.bench.workload import Arrival
from kvgate.sim.runs import ClientModel
from kvgate.testing import FakeEngine

SLO = Slo(ttft_s=1.0, tpot_s=0.1, long_ttft_s=5.0)

# The fake engine holds 16,384 KV tokens and reports 10% of them used: under the 0.92
# panic watermark there is room for 4 requests of 3,000 + 50 tokens (+ 16 of rounding), so
# a burst of 10 leaves 6 to wait. Each streams 50 events 10 ms apart: the burst is over in
# about 1.5 s.
BURST = 10
PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 50


async def test_a_live_run_through_kvgate_reports_its_queue(gateway_factory: Any) -> None:
    engine = await FakeEngine(chunks=OUTPUT_TOKENS, interval=0.01).start()
    try:
        gw = await gateway_factory([engine.url], policy="adaptive")
        async with httpx.AsyncClient(base_url=gw.url) as client:
            assert await until_ready(client), "the gateway never had a fresh sample"
        arrivals = [
            Arrival(f"u{i}", 0.0, "long", PROMPT_TOKENS, OUTPUT_TOKENS) for i in range(BURST)
        ]
        target = LiveTarget([gw.url], [engine.url], "fake-model", gateway=gw.url)
        options = LiveOptions(
            policy="adaptive",
            load=1.0,
            seed=0,
            preset="fake",
            duration_s=1.0,
            warmup_s=0.0,
            slo=SLO,
            drain_s=20.0,
            step_s=0.05,
        )
        run = await run_live(arrivals, ClientModel(timeout_s=30.0, max_attempts=1), target, options)
        own = gw.gateway.admission.snapshot()["queue"]
    finally:
        await engine.stop()
    # Every request was served, none refused: part of the burst waited instead.
    outcomes = [r.attempts[-1].outcome for r in run.requests]
    assert outcomes == [OK] * BURST, run.extra["refusals_by_reason"]
    told = run.extra["gateway_queue"]
    counters = own["counters"]
    assert told["queued"] == counters["queued"] >= 1
    assert told["started_after_wait"] == counters["admitted_after_wait"] == told["queued"]
    assert told["left_while_waiting"] == 0
    # The histogram counts the same waits as the counters, with the same total time.
    assert told["waits"] == told["queued"]
    assert told["wait_mean_s"] == pytest.approx(own["wait_total_s"] / told["queued"], rel=0.05)
    assert 0 < told["wait_mean_s"] <= told["wait_p90_s"] * 1.5
    # The load generator saw requests waiting in kvgate while the burst lasted.
    assert told["peak_waiting"] == max(w for w in run.series["queued"] if not math.isnan(w))
    assert 1 <= told["peak_waiting"] <= told["queued"]
    # And the summary row carries it.
    assert figures(run)["queued"] == told["queued"]


def test_wait_histogram_from_a_metrics_page_sums_priorities_and_subtracts_a_reading() -> None:
    page = "\n".join(
        [
            "# HELP kvgate_queue_wait_seconds Time requests spent waiting.",
            "# TYPE kvgate_queue_wait_seconds histogram",
            *(
                f'kvgate_queue_wait_seconds_bucket{{le="{le}",priority="{p}"}} {n}'
                for p, counts in (("standard", (2, 6, 8, 8)), ("critical", (0, 1, 2, 2)))
                for le, n in zip(("1.0", "2.5", "5.0", "+Inf"), counts, strict=True)
            ),
            'kvgate_queue_wait_seconds_count{priority="standard"} 8.0',
            'kvgate_queue_wait_seconds_sum{priority="standard"} 14.0',
            'kvgate_queue_wait_seconds_count{priority="critical"} 2.0',
            'kvgate_queue_wait_seconds_sum{priority="critical"} 6.0',
            "# TYPE other_seconds gauge",
            "other_seconds 3.0",
            "",
        ]
    )
    waits = wait_histogram(page)
    assert waits.buckets == ((1.0, 2.0), (2.5, 7.0), (5.0, 10.0), (math.inf, 10.0))
    assert (waits.count, waits.total_s, waits.mean_s) == (10.0, 20.0, 2.0)
    # Rank 9 of 10 lies in the (2.5, 5] bucket, which holds ranks 8-10: 2/3 of the way.
    assert waits.quantile(0.9) == pytest.approx(2.5 + 2.5 * (2 / 3))
    assert waits.quantile(0.1) == pytest.approx(0.5)  # rank 1 of the 2 in (0, 1]
    earlier = WaitHistogram(((1.0, 2.0), (2.5, 2.0), (5.0, 2.0), (math.inf, 2.0)), 2.0, 1.0)
    run = waits.since(earlier)
    assert run.buckets == ((1.0, 0.0), (2.5, 5.0), (5.0, 8.0), (math.inf, 8.0))
    assert (run.count, run.total_s) == (8.0, 19.0)
    # Past the last finite bound, the quantile is that bound (as histogram_quantile says).
    tail = WaitHistogram(((1.0, 1.0), (math.inf, 4.0)), 4.0, 40.0)
    assert tail.quantile(0.9) == 1.0
    assert math.isnan(WaitHistogram().quantile(0.9)) and math.isnan(WaitHistogram().mean_s)
    assert wait_histogram("other_seconds 3.0\n") == WaitHistogram()


def test_queue_summary_is_the_difference_of_two_states() -> None:
    def state(queued: int, started: int, cancelled: int) -> dict[str, Any]:
        counters = {"queued": queued, "admitted_after_wait": started, "cancelled": cancelled}
        return {"policy": {"queue": {"waiting": 0, "counters": counters}}}

    waits = WaitHistogram(((1.0, 3.0), (math.inf, 4.0)), 4.0, 6.0)
    summary = queue_summary(state(5, 4, 1), state(12, 10, 2), waits, 6.0)
    assert summary == {
        "peak_waiting": 6.0,
        "queued": 7.0,
        "started_after_wait": 6.0,
        "left_while_waiting": 1.0,
        "waits": 4.0,
        "wait_mean_s": 1.5,
        "wait_p90_s": 1.0,
    }
    # A gateway that did not answer before the run: its counters count from zero.
    assert queue_summary(None, state(3, 3, 0), WaitHistogram(), 2.0)["queued"] == 3.0


def _run(policy: str, series: dict[str, list[float]], **extra: Any) -> RunResult:
    waited = [Attempt(0.0, 2.0, OK, 1.5, 5, waited_s=w) for w in (0.0, 1.0, 3.0)]
    requests = [UserRequest(f"r{i}", "chat", 0.0, 10, 5, 30.0, [a]) for i, a in enumerate(waited)]
    return RunResult(policy, 3.0, 1, "test", 1, 10.0, 0.0, SLO, requests, EngineTotals(),
                     series=series, extra=dict(extra))  # fmt: skip


def test_queue_figures_of_live_virtual_and_direct_runs(tmp_path: Path) -> None:
    told = {"peak_waiting": 6.0, "queued": 9.0, "started_after_wait": 8.0,
            "left_while_waiting": 1.0, "waits": 9.0, "wait_mean_s": 1.25,
            "wait_p90_s": 2.5}  # fmt: skip
    t = {"t": [0.0, 1.0]}
    live = _run("adaptive", {**t, "queued": [2.0, 6.0]}, gateway_queue=told)
    assert figures(live) == {k: told[k] for k in figures(live)}
    # Virtual: the waits of the requests that started, exactly; the total queued unknown.
    virtual = figures(_run("adaptive", {**t, "queued": [0.0, 2.0]}))
    assert virtual["peak_waiting"] == 2.0 and virtual["started_after_wait"] == 2.0
    assert virtual["wait_mean_s"] == 2.0 and virtual["wait_p90_s"] == pytest.approx(2.8)
    assert math.isnan(virtual["queued"])
    # Straight to the engines (live): no gateway, no queue figures.
    direct = _run("direct", {**t, "queued": [math.nan, math.nan]})
    direct.requests = direct.requests[:1]
    assert all(math.isnan(v) for v in figures(direct).values())
    # The report gives the queue its own table, for the runs that had one.
    meta = ReportMeta("test", "kvgate bench", [1], {}, {}, {"goodput_tok_s": 1.0})
    text = write_report([direct, live], meta, tmp_path).read_text()
    section = text.split("## The gateway's queue", 1)[1].split("##", 1)[0]
    assert "| 3x | `adaptive` | 6 | 9 | 8 | 1.25 | 2.50 |" in section
    assert "`direct`" not in section
