"""The benchmark's scoring on records small enough to check by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvgate.bench.metrics import (
    OK,
    SHED,
    TIMEOUT,
    Attempt,
    EngineTotals,
    RunResult,
    Slo,
    UserRequest,
    recovery_time,
    retry_after_histogram,
    summarize,
    within_slo,
)
from kvgate.bench.report import ReportMeta, write_report

SLO = Slo(ttft_s=1.0, tpot_s=0.1, long_ttft_s=5.0)


def _run(requests: list[UserRequest], **kw: object) -> RunResult:
    base: dict[str, object] = dict(
        policy="adaptive",
        load=3.0,
        seed=1,
        preset="test",
        nodes=1,
        duration_s=10.0,
        warmup_s=0.0,
        slo=SLO,
        requests=requests,
        totals=EngineTotals(preemptions=2, recomputed_tokens=300, zombie_tokens=7),
    )
    base.update(kw)
    return RunResult(**base)  # type: ignore[arg-type]


def _hand_checkable() -> list[UserRequest]:
    # a: served at once, TTFT 0.5 s, 11 tokens in 1.5 s -> TPOT 0.1 s: within SLO.
    a = UserRequest("a", "chat", 1.0, 50, 11, 30.0, [Attempt(1.0, 2.5, OK, 1.5, 11)])
    # b: shed once (Retry-After 2 s), then served; TTFT from the user's first try = 2.2 s > 1 s.
    b = UserRequest(
        "b",
        "chat",
        2.0,
        50,
        5,
        30.0,
        [Attempt(2.0, 2.0, SHED, retry_after_s=2.0), Attempt(4.0, 4.6, OK, 4.2, 5)],
    )
    # c: timed out twice and gave up: nothing delivered counts.
    c = UserRequest(
        "c",
        "long",
        3.0,
        500,
        100,
        2.0,
        [Attempt(3.0, 5.0, TIMEOUT, 4.0, 20), Attempt(5.0, 7.0, TIMEOUT, None, 0)],
    )
    # d: arrived before the warm-up ends in the warm-up test, a long request within SLO.
    d = UserRequest("d", "long", 0.5, 500, 3, 30.0, [Attempt(0.5, 4.0, OK, 3.8, 3)])
    return [a, b, c, d]


def test_summary_numbers_match_hand_computation() -> None:
    s = summarize(_run(_hand_checkable()))
    assert s["user_requests"] == 4
    assert s["completed"] == 3
    assert s["goodput_tok_s"] == pytest.approx((11 + 5 + 3) / 10.0)
    assert s["goodput_req_s"] == pytest.approx(0.3)
    # a and d meet the SLO; b's user waited 2.2 s for a first token; c never finished.
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["attempts_per_request"] == pytest.approx(6 / 4)
    assert s["rejected_429"] == 1
    assert s["timeouts"] == 2
    assert s["gave_up"] == 1
    # admitted TTFTs: a 0.5, b 0.2, c 1.0, d 3.3 -> p50 = 0.75
    assert s["ttft_p50_s"] == pytest.approx(0.75)
    assert s["tpot_p50_s"] == pytest.approx(0.1)  # a: 1.0/10, b: 0.4/4, d: 0.2/2
    assert s["preemptions"] == 2 and s["zombie_tokens"] == 7
    assert s["retry_after_p50_s"] == pytest.approx(2.0)


def test_warmup_excludes_early_arrivals() -> None:
    s = summarize(_run(_hand_checkable(), warmup_s=1.0))
    assert s["user_requests"] == 3
    assert s["goodput_tok_s"] == pytest.approx((11 + 5) / 9.0)


def test_slo_uses_the_users_first_try_and_kind() -> None:
    a, b, c, d = _hand_checkable()
    assert within_slo(a, SLO)
    assert not within_slo(b, SLO)
    assert not within_slo(c, SLO)
    assert within_slo(d, SLO)  # 3.3 s TTFT is within the 5 s long-prompt SLO
    assert retry_after_histogram(_run([a, b, c, d])) == {2: 1}


def test_recovery_time_from_the_waiting_series() -> None:
    t = [i * 0.5 for i in range(40)]  # 20 s
    waiting = [0.0] * 40
    for k in range(20, 26):  # burst at 10 s: the queue is long until 13 s
        waiting[k] = 50.0
    run = _run([], series={"t": t, "waiting": waiting, "preemptions": [0.0] * 40}, bursts=[10.0])
    run.duration_s = 20.0
    assert recovery_time(run) == pytest.approx(3.0)
    assert run.extra["unrecovered_bursts"] == 0
    never = _run([], series={"t": t, "waiting": [0.0] * 20 + [99.0] * 20}, bursts=[10.0])
    never.duration_s = 20.0
    assert recovery_time(never) == pytest.approx(10.0)
    assert never.extra["unrecovered_bursts"] == 1
    assert math.isnan(recovery_time(_run([])))


def test_report_writes_markdown_plots_and_json(tmp_path: Path) -> None:
    runs = [
        _run(_hand_checkable(), policy=p, load=load, series={"t": [0.0, 1.0], "waiting": [0, 0]})
        for p in ("direct", "adaptive")
        for load in (1.0, 3.0)
    ]
    meta = ReportMeta(
        title="test",
        command="kvgate bench --quick",
        seeds=[1],
        scenario={"nodes": 1},
        slo={"ttft_s": 1.0},
        capacity={"goodput_tok_s": 2.0},
    )
    report = write_report(runs, meta, tmp_path)
    text = report.read_text()
    assert "kvgate bench --quick" in text
    assert "| 3x | `adaptive` |" in text
    assert "FAIL: `direct` goodput at 3x is 95% of capacity" in text
    for name in ("goodput_vs_load.png", "timeseries_1x.png", "timeseries_3x.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "results.json").exists()
