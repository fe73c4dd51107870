"""The queue's settings: a partial table changes only what it names."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvgate.core.request import Priority
from kvgate.core.settings import QueueSettings


def test_a_partial_wait_table_keeps_the_other_priorities_defaults() -> None:
    queue = QueueSettings(max_wait_s={"sheddable": 5})
    assert queue.wait_for(Priority.SHEDDABLE) == 5
    assert queue.wait_for(Priority.STANDARD) == QueueSettings().wait_for(Priority.STANDARD) > 0
    assert queue.wait_for(Priority.CRITICAL) == QueueSettings().wait_for(Priority.CRITICAL) > 0


def test_caps_keep_their_defaults_and_null_lifts_one() -> None:
    queue = QueueSettings(max_waiting={"sheddable": 3}, max_waiting_tokens={"total": None})
    assert queue.cap(queue.max_waiting, "sheddable") == 3
    assert queue.cap(queue.max_waiting, "total") == QueueSettings().cap(
        QueueSettings().max_waiting, "total"
    )
    assert queue.cap(queue.max_waiting_tokens, "total") is None


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValidationError, match="must not be negative"):
        QueueSettings(max_wait_s={"standard": -1})
