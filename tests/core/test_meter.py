"""What `NodeMeter` measures of one engine, fed by hand (times are plain numbers)."""

from __future__ import annotations

import pytest

from kvgate.core.plan.meter import (
    PREEMPTING_S,
    PRIOR_PREFILL_TOKENS_PER_STEP,
    PRIOR_STEP_S,
    NodeMeter,
)


def test_prefill_pace_is_a_prior_of_the_idle_step_until_a_long_prompt_measures_it() -> None:
    meter = NodeMeter()
    assert meter.idle_step_s() == PRIOR_STEP_S
    assert not meter.prefill_measured()
    meter.sampled(1.0, 0.004, None, (), 0.004, False, 0)
    assert meter.prefill_s_per_token() == pytest.approx(0.004 / PRIOR_PREFILL_TOKENS_PER_STEP)
    meter.first_token(100, 5.0)  # a short prompt's first token is one step: says nothing
    assert not meter.prefill_measured()
    for ttft in (0.4, 0.1, 0.2, 0.3, 0.5):  # 1,000-token prompts, some queued behind others
        meter.first_token(1000, ttft)
    assert meter.prefill_measured()
    # The lower quartile: queueing only ever lengthens a first token.
    assert meter.prefill_s_per_token() == pytest.approx(0.2 / 1000)
    assert meter.recompute_s(5000) == pytest.approx(1.0)


def test_the_idle_step_is_the_lowest_of_the_baseline_and_the_decode_only_step() -> None:
    meter = NodeMeter()
    meter.sampled(1.0, 0.050, None, (), None, False, 0)  # prefilling: not an idle step
    assert meter.idle_step_s() == PRIOR_STEP_S
    assert meter.step_s() == pytest.approx(0.050)
    meter.sampled(2.0, 0.006, None, (), None, True, 0)
    assert meter.idle_step_s() == pytest.approx(0.006)
    meter.sampled(3.0, 0.009, None, (), 0.005, False, 0)
    assert meter.idle_step_s() == pytest.approx(0.005)


def test_preemptions_are_priced_at_the_size_of_the_newest_requests() -> None:
    meter = NodeMeter()
    for _ in range(4):
        meter.first_token(1000, 0.1)  # 0.1 ms per prompt token
    assert meter.sampled(1.0, 0.005, 0.0, (900, 800, 700), None, False, 3) == 0
    assert not meter.preempting(1.0)
    # Two preemptions: the engine took its two newest requests.
    assert meter.sampled(2.0, 0.005, 2.0, (900, 800, 700), None, False, 3) == 2
    assert meter.recomputed_tokens == 1700
    assert meter.preempting(2.0) and not meter.preempting(2.0 + PREEMPTING_S + 0.1)
    assert meter.recompute_share(2.0) > 0
    snap = meter.snapshot(2.0)
    assert snap["recomputed_tokens"] == 1700 and snap["preemptions_per_s"] > 0
    # A counter that went back (an engine restart) counts nothing.
    assert meter.sampled(3.0, 0.005, 0.0, (900,), None, False, 3) == 0
    assert meter.recomputed_tokens == 1700


def test_time_per_output_token_is_the_streams_open_time_over_the_tokens_they_got() -> None:
    meter = NodeMeter()
    assert meter.tpot_s(0.0) is None
    meter.sampled(0.0, 0.005, None, (), None, True, 4)
    t = 0.0
    for _ in range(200):  # 4 streams, one token each per 50 ms, for 10 s
        t += 0.05
        meter.produced(t, 4)
        meter.sampled(t, 0.005, None, (), None, True, 4)
    tpot = meter.tpot_s(t)
    assert tpot is not None and tpot == pytest.approx(0.05, rel=0.05)
    assert meter.yield_tok_s(t) == pytest.approx(80, rel=0.05)
    assert meter.peak_yield(t) >= meter.yield_tok_s(t)
