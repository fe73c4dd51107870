"""Fixtures for the operator-view tests: a headless system Chromium page."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opview_browser import browser, missing_reason, new_page


@pytest.fixture(scope="session")
def chromium() -> Iterator[Any]:
    """Debian's Chromium under Playwright; skips (saying why) when it is not installed."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"browser test skipped: {reason}")
    with browser() as instance:
        yield instance


@pytest.fixture
def browser_page(chromium: Any) -> Iterator[Any]:
    """A fresh page that records page errors and console errors in `kvgate_errors`."""
    with new_page(chromium) as p:
        errors: list[str] = []
        p.on("pageerror", lambda exc: errors.append(str(exc)))
        p.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        p.kvgate_errors = errors  # type: ignore[attr-defined]
        yield p
