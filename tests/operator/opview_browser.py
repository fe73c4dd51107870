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
    """The system browser (`apt-get install chromium`), or None when it is not installed.

    `KVGATE_CHROMIUM`, when set, is the only place looked at.
    """
    chosen = os.environ.get("KVGATE_CHROMIUM")
    if chosen:
        return chosen if os.path.exists(chosen) else None
    if os.path.exists("/usr/bin/chromium"):
        return "/usr/bin/chromium"
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
def browser() -> Iterator[Any]:
    """A headless system Chromium (one per test session: it takes seconds to start)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@contextmanager
def new_page(instance: Any, width: int = 1600, height: int = 1300) -> Iterator[Any]:
    """A fresh page in its own context; closed however the test ends."""
    # The page's CSP forbids eval; Playwright's wait_for_function needs it.
    context = instance.new_context(viewport={"width": width, "height": height}, bypass_csp=True)
    try:
        yield context.new_page()
    finally:
        context.close()


@contextmanager
def page(width: int = 1600, height: int = 1300) -> Iterator[Any]:
    """A page in a browser of its own, for scripts outside pytest."""
    with browser() as instance, new_page(instance, width, height) as p:
        yield p
