"""Tiny virtual-time runs whose outcome can be worked out by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.bench.metrics import OK, SHED, TIMEOUT, Slo, summarize
from kvgate.bench.profiles import get_profile
from kvgate.bench.report import ReportMeta, write_report
from kvgate.bench.suite import RunSpec
from kvgate.bench.virtual import run_virtual
from kvgate.bench.workload import Arrival, Shape
from kvgate.sim.runs import ClientModel

SHAPE = Shape(kv_capacity_tokens=4096, chat_rate=0, long_rate=0, burst_every_s=0, burst_per_node=0)


def _spec(**kw: object) -> RunSpec:
    base: dict[str, object] = dict(
        preset="cpu-tiny",
        nodes=1,
        shape=SHAPE,
        load=1.0,
        seed=1,
        duration_s=10.0,
        warmup_s=0.0,
        client=ClientModel(timeout_s=5.0, max_attempts=3),
        slo=Slo(ttft_s=1.0, tpot_s=0.05, long_ttft_s=3.0),
        label="direct",
        policy="none",
    )
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def test_two_chats_on_an_idle_engine_are_served_once_each() -> None:
    arrivals = [Arrival("a", 1.0, "chat", 50, 100), Arrival("b", 2.0, "chat", 40, 60)]
    run = run_virtual(_spec(), arrivals)
    s = summarize(run)
    assert [r.attempts[-1].outcome for r in run.requests] == [OK, OK]
    assert [r.success.output_tokens for r in run.requests if r.success] == [100, 60]
    assert s["goodput_tok_s"] == pytest.approx(160 / 10.0)
    assert s["slo_attainment"] == 1.0 and s["attempts_per_request"] == 1.0
    assert s["preemptions"] == 0 and s["zombie_tokens"] == 0
    # cpu-tiny alone: a 50-token prefill takes a few ms, a token 3-4 ms.
    assert 0 < s["ttft_p99_s"] < 0.05
    assert 0.003 < s["tpot_p50_s"] < 0.005
    assert run.totals.generated_tokens == 160


def test_timeouts_are_retried_then_given_up_and_cancellation_decides_zombies() -> None:
    # 1,000 tokens take ~3.5 s alone; a 0.5 s timeout can never be met.
    arrivals = [Arrival("x", 0.5, "long", 1000, 1000)]
    client = ClientModel(timeout_s=0.5, max_attempts=3)
    cancelled = run_virtual(_spec(client=client), arrivals)
    (user,) = cancelled.requests
    assert [a.outcome for a in user.attempts] == [TIMEOUT] * 3
    s = summarize(cancelled)
    assert s["gave_up"] == 1 and s["goodput_tok_s"] == 0 and s["attempts_per_request"] == 3
    # The engine drops an aborted request at its next step: at most one step's token each.
    assert cancelled.totals.zombie_tokens <= 3
    zombies = run_virtual(_spec(client=client, cancel=False, label="nocancel"), arrivals)
    # Without cancellation each abandoned attempt runs to its end, the three sharing the
    # engine: ~3 x 1,000 tokens generated, only what arrived before each timeout delivered.
    delivered = sum(a.output_tokens for a in zombies.requests[0].attempts)
    assert zombies.totals.generated_tokens == 3000
    assert zombies.totals.zombie_tokens == pytest.approx(3000 - delivered, abs=3)


def test_a_client_that_says_its_timeout_is_refused_not_served_to_nobody() -> None:
    """The same hopeless request through kvgate: saying its 0.5 s timeout (as the OpenAI
    SDKs do), each try gets its 429 `client_deadline` and the engine makes no token for
    nobody; saying nothing, the tries start and time out."""
    arrivals = [Arrival("x", 0.5, "long", 1000, 1000)]
    adaptive = {"label": "adaptive", "policy": "adaptive"}
    said = ClientModel(timeout_s=0.5, max_attempts=3, says_timeout=True)
    refused = run_virtual(_spec(client=said, **adaptive), arrivals)
    assert [a.outcome for a in refused.requests[0].attempts] == [SHED] * 3
    assert refused.totals.generated_tokens == 0 and refused.totals.zombie_tokens == 0
    silent = run_virtual(_spec(client=replace(said, says_timeout=False), **adaptive), arrivals)
    assert TIMEOUT in [a.outcome for a in silent.requests[0].attempts]
    assert silent.totals.generated_tokens > 0


def test_a_token_bucket_sheds_with_retry_after_and_the_client_waits(tmp_path: Path) -> None:
    arrivals = [Arrival(f"c{i}", 1.0 + 0.001 * i, "chat", 50, 20) for i in range(3)]
    spec = _spec(
        label="static-qps",
        policy="static-qps",
        policy_overrides={"baseline": {"qps": 1.0, "burst": 1}},
    )
    run = run_virtual(spec, arrivals)
    s = summarize(run)
    assert s["completed"] == 3  # everyone got through after waiting
    assert s["rejected_429"] >= 2
    for user in run.requests:
        for first, second in zip(user.attempts, user.attempts[1:], strict=False):
            assert first.outcome == SHED
            assert second.start == pytest.approx(first.end + first.retry_after_s)
    meta = ReportMeta("tiny", "pytest", [1], {}, {}, {"goodput_tok_s": 6.0}, focus_load=1.0)
    report = write_report([run, replace(run, policy="adaptive")], meta, tmp_path)
    assert "| 1x | `static-qps` |" in report.read_text()


def test_a_scenario_run_is_deterministic_for_its_seed() -> None:
    prof = get_profile("cpu-tiny")
    spec = _spec(shape=prof.shape, nodes=2, load=3.0, duration_s=8.0, client=prof.client,
                 label="adaptive", policy="adaptive")  # fmt: skip

    def records(seed: int) -> list[tuple]:
        run = run_virtual(replace(spec, seed=seed))
        return [
            (u.id, u.arrival, a.outcome, a.start, a.end, a.output_tokens, a.node)
            for u in run.requests
            for a in u.attempts
        ]

    first = records(1)
    assert len(first) > 50
    assert first == records(1)
    assert first != records(2)
