"""Debian's system Chromium driven by Playwright: never a downloaded browser build."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """The system browser (`apt-get install chromium`), or None when it is not installed."""
    for candidate in (os.environ.get("KVGATE_CHROMIUM"), "/usr/bin/chromium"):
        if candidate and os.path.exists(candidate):
            return candidate
    return shutil.which("chromium")


def missing_reason() -> str | None:
    """Why a browser test cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install 'playwright>=1.40,<2')"
    if chromium_path() is None:
        return "Debian's chromium is not installed (apt-get install -y chromium)"
    return None


@contextmanager
def page(width: int = 1600, height: int = 1300) -> Iterator[Any]:
    """A fresh page in a headless system Chromium; closed however the test ends."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            # The page's CSP forbids eval; Playwright's wait_for_function needs it.
            context = browser.new_context(
                viewport={"width": width, "height": height}, bypass_csp=True
            )
            yield context.new_page()
        finally:
            browser.close()
