"""The dashboard against a running gateway with simulated engines, in a real browser."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
from opview_cluster import Overload, gateway_with_sims

WAIT_MS = 30_000
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard-overload.png"


def test_live_gateway_overload_is_charted_and_a_dead_engine_is_flagged(
    browser_page: Any, tmp_path: Path
) -> None:
    page = browser_page
    with gateway_with_sims(tmp_path) as cluster:
        page.goto(cluster.url + "/dashboard")
        page.wait_for_function("window.kvgate && kvgate.updates >= 3", timeout=WAIT_MS)
        assert page.locator("#node-rows tr.node").count() == len(cluster.engines)

        with Overload(cluster.url) as load:
            page.wait_for_function(
                "kvgate.charts['c-admitted'].nonZero > 0 && "
                "kvgate.charts['c-rejected'].nonZero > 0",
                timeout=WAIT_MS,
            )
            page.wait_for_function("kvgate.charts['c-kv'].nonZero > 0", timeout=WAIT_MS)
            cluster.kill_engine_process("victim")
            page.wait_for_function("kvgate.staleNodes().includes('sim-victim')", timeout=WAIT_MS)
            row = page.locator('tr.node[data-node="sim-victim"]')
            assert row.locator(".badge").inner_text().lower() == "stale"
            assert page.locator("#t-rejected").inner_text() != "–"
            if os.environ.get("KVGATE_SCREENSHOT"):
                page.wait_for_timeout(int(os.environ["KVGATE_SCREENSHOT"]) * 1000)
                page.set_viewport_size({"width": 1600, "height": 940})
                SCREENSHOT.parent.mkdir(exist_ok=True)
                page.screenshot(path=str(SCREENSHOT), full_page=True)
        counts = load.counts
        # Load over: the live engines answer their scrapes in time again (on a 2-core test
        # machine they may miss a few while the load runs), the dead one stays flagged.
        page.wait_for_function(
            "kvgate.staleNodes().length === 1 && kvgate.staleNodes()[0] === 'sim-victim'",
            timeout=WAIT_MS,
        )
        state = httpx.get(cluster.url + "/admin/state", timeout=5).json()
    assert counts.get("200", 0) + counts.get("hung_up", 0) > 0, counts
    assert counts.get("429", 0) > 0, counts  # it really was an overload
    assert state["policy"]["nodes"]["sim-victim"]["fresh"] is False
    assert page.kvgate_errors == []
