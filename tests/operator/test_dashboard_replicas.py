"""The dashboard of one of two replicas, in a real headless browser: it shows both
replicas, the store's health, and which engines this replica takes from the store.

Real `kvgate serve` processes on a real redis-server, Debian's Chromium driven by
Playwright's asyncio API (the fake engines run in this test's event loop). Skipped, saying
why, when Chromium, Playwright or redis-server is missing, except in CI.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from cluster.helpers import Replica, replicas, state, synced_again
from opview_browser import CHROMIUM_ARGS, chromium_path, missing_reason

from kvgate.procs.redis_server import RedisServer, find_redis_server

WAIT_MS = 30_000
pytestmark = pytest.mark.timeout(180)


def _needs() -> str | None:
    reason = missing_reason()
    if reason is None and find_redis_server() is None:
        reason = "redis-server is not installed (apt-get install redis-server)"
    return reason


async def test_dashboard_shows_the_replicas_and_the_engines_they_share(
    engine_factory: Any, tmp_path: Path
) -> None:
    reason = _needs()
    if reason is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    engines = [await engine_factory() for _ in range(4)]
    with RedisServer.start(port=0) as redis:
        async with replicas(2, redis.url, engines) as served, async_playwright() as pw:
            await synced_again(served, "started")
            viewer = await _not_polling_everything(served)
            browser = await pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                context = await browser.new_context(
                    viewport={"width": 1600, "height": 1300}, bypass_csp=True
                )
                page = await context.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(viewer.url + "/dashboard")
                await page.wait_for_function(
                    "!document.getElementById('replicas').hidden"
                    " && document.querySelectorAll('#replica-rows tr').length === 2",
                    timeout=WAIT_MS,
                )
                await page.wait_for_function(
                    "[...document.querySelectorAll('#node-rows td')]"
                    ".some(td => td.textContent === 'shared')",
                    timeout=WAIT_MS,
                )
                summary = await page.text_content("#replica-summary")
                rows = await page.inner_text("#replica-rows")
                await page.screenshot(path=str(tmp_path / "replicas.png"), full_page=True)
            finally:
                await browser.close()
    assert summary is not None and "(2)" in summary and "SYNCED" in summary, summary
    assert rows.count("(this one)") == 1, rows
    assert not errors, errors


async def _not_polling_everything(served: list[Replica]) -> Replica:
    """The replica that owns fewer engines (rendezvous hashing may give one replica all
    four): its dashboard shows the engines it takes from the store as shared."""
    owned = []
    for gw in served:
        cluster = (await state(gw))["cluster"]
        mine = sum(owner == cluster["member_id"] for owner in cluster["shards"].values())
        owned.append((mine, gw.url))
    fewest = min(owned)[1]
    return next(gw for gw in served if gw.url == fewest)
