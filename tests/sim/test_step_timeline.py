"""The live engine's step timeline: the loop's own time between steps is not the model's."""

from __future__ import annotations

import pytest

from kvgate.sim.server import StepTimeline


def test_time_between_steps_is_paid_back_from_the_next_sleep() -> None:
    timeline = StepTimeline(max_behind_s=0.05)
    due = timeline.schedule(0.0, 0.010)
    ends = [due]
    for _ in range(4):
        # the loop wakes handlers and writes chunks for 3 ms after each step ends
        ends.append(timeline.schedule(ends[-1] + 0.003, 0.010))
    assert ends == pytest.approx([0.010, 0.020, 0.030, 0.040, 0.050])


def test_a_stall_longer_than_the_slack_restarts_the_timeline() -> None:
    timeline = StepTimeline(max_behind_s=0.05)
    timeline.schedule(0.0, 0.010)
    # 200 ms late: catching up would run steps back to back with no sleep for 200 ms
    assert timeline.schedule(0.210, 0.010) == pytest.approx(0.220)
    assert timeline.schedule(0.221, 0.010) == pytest.approx(0.230)


def test_after_idling_the_next_step_starts_from_its_own_start() -> None:
    timeline = StepTimeline()
    timeline.schedule(0.0, 0.010)
    timeline.reset()  # nothing to do for a while
    assert timeline.schedule(0.011, 0.010) == pytest.approx(0.021)
    timeline.reset()
    assert timeline.schedule(5.0, 0.020) == pytest.approx(5.020)
