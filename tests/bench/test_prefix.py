"""Routings compared on shared-prefix traffic (`kvgate bench prefix`): small virtual runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.bench.prefix import (
    ROUTINGS,
    START_S,
    WORKLOADS,
    Routing,
    caching,
    run,
    traffic,
)
from kvgate.cli import main
from kvgate.sim.prefix_workloads import Chats

ENGINE = caching("gpu-8b")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_shares_prefixes_and_starts_after_the_first_scrape(workload: str) -> None:
    load = traffic(workload, seed=3, conversations=20, rate_rps=40.0, duration_s=2.0)
    assert load.arrivals and all(a.arrival >= START_S for a in load.arrivals)
    assert all(a.prompt_ids is not None for a in load.arrivals)
    assert all(load.issued[a.id].prompt_ids == a.prompt_ids for a in load.arrivals)
    heads = {a.prompt_ids[:200] for a in load.arrivals if a.prompt_ids is not None}
    assert len(heads) < len(load.arrivals)  # prefixes are shared
    assert (load.follow_ups is not None) == (workload == "chats")
    assert isinstance(load.follow_ups, Chats) or load.duration_s == START_S + 2.0


def test_a_burst_at_the_start_is_answered_once_the_gateway_knows_the_engines() -> None:
    # 300 requests/s: a dozen arrive within the gateway's first scrape interval after the
    # start; the admission policy knows every engine by then, so none is refused as
    # unavailable.
    load = traffic("hot-prefix", seed=1, rate_rps=300.0, duration_s=1.0)
    r = run(ROUTINGS["headroom-only"], load, ENGINE, nodes=2, seed=1)
    assert r["ok"] == r["requests"] == len(load.arrivals)


def test_a_comparison_run_scores_hits_against_the_ideal_and_each_engine() -> None:
    load = traffic("chats", seed=2, conversations=30)
    r = run(ROUTINGS["round-robin"], load, ENGINE, nodes=2, seed=2)
    assert r["ok"] == r["requests"] == 150
    assert 0.0 < r["hit_rate"] <= r["ideal_hit_rate"] < 1.0
    assert r["hit_vs_ideal"] == pytest.approx(r["hit_rate"] / r["ideal_hit_rate"])
    assert 0.0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
    assert r["output_tok_per_s"] == pytest.approx(150 * 300 / r["duration_s"])
    assert len(r["kv_peak"]) == 2 and all(0.0 < k < 1.0 for k in r["kv_peak"])
    assert r["above_panic"] == 0 and r["idle_while_queued_s"] == [0.0, 0.0]


def test_a_routing_registers_with_one_line() -> None:
    ROUTINGS["adaptive-events"] = Routing("adaptive", kv_events=True)
    try:
        load = traffic("tenants", seed=1, rate_rps=20.0, duration_s=1.0)
        r = run(ROUTINGS["adaptive-events"], load, ENGINE, nodes=2, seed=1)
        assert r["ok"] == r["requests"] > 0
    finally:
        del ROUTINGS["adaptive-events"]


def test_kvgate_bench_prefix_writes_its_report(tmp_path: Path) -> None:
    argv = ["bench", "prefix", "--workload", "rag", "--nodes", "2", "--rate", "10"]
    argv += ["--duration", "2", "--policies", "round-robin,headroom-only", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = (tmp_path / "report.md").read_text()
    assert "kvgate bench prefix --workload rag --nodes 2 --duration 2" in text
    assert "| round-robin |" in text and "| headroom-only |" in text
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert set(runs["1"]) == {"round-robin", "headroom-only"}
    assert (tmp_path / "routing.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--policies", "direct"], "unknown policy 'direct'"),
        (["--conversations", "0"], "--conversations must be at least 1"),
        (["--rate", "-2"], "--rate must be positive"),
    ],
)
def test_bad_prefix_arguments_get_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "prefix", *extra]) == 2
    assert message in capsys.readouterr().err
