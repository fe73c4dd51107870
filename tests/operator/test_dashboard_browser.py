"""The dashboard in a real headless browser, fed by 64 synthetic nodes.

64 real engines would not fit on a 2-core test machine next to a browser; the synthetic
source produces the gateway's exact `/admin/state` shape and runs behind the real dashboard
routes on uvicorn, so what is tested is the page itself: it renders 64 nodes, keeps up with
5 updates a second, charts an overload and flags a stale node.
"""

from __future__ import annotations

from typing import Any

from opview_synthetic import SyntheticCluster, router, serve

WAIT_MS = 15_000


def _chart(page: Any, key: str) -> dict[str, int]:
    return page.evaluate(
        "k => ({points: kvgate.charts[k].points, nonZero: kvgate.charts[k].nonZero})", key
    )


def test_dashboard_renders_64_nodes_charts_an_overload_and_flags_a_stale_node(
    browser_page: Any,
) -> None:
    page = browser_page
    cluster = SyntheticCluster(64)
    with serve(router(cluster.state)) as url:
        page.goto(url + "/dashboard")
        page.wait_for_function("window.kvgate && kvgate.updates >= 5", timeout=WAIT_MS)
        assert page.locator("#node-rows tr.node").count() == 64
        assert page.locator("#conn").inner_text() == "live"
        assert page.locator("#policy").inner_text() == "adaptive"
        assert _chart(page, "c-rejected")["nonZero"] == 0  # calm: nothing shed yet

        cluster.overload = True
        cluster.stale.add("node-17")
        page.wait_for_function(
            "kvgate.charts['c-rejected'].nonZero > 0 && kvgate.staleNodes().includes('node-17')",
            timeout=WAIT_MS,
        )
        before = _chart(page, "c-admitted")["points"]
        page.wait_for_function(
            f"kvgate.charts['c-admitted'].points > {before} + 3", timeout=WAIT_MS
        )

        stale_row = page.locator('tr.node[data-node="node-17"]')
        assert "state-stale" in (stale_row.get_attribute("class") or "")
        assert stale_row.locator(".badge").inner_text().lower() == "stale"
        assert page.locator("#node-rows tr.node.state-stale").count() == 1
        # Worst first: the stale node is at the top, above the merely high ones.
        assert page.locator("#node-rows tr.node").first.get_attribute("data-node") == "node-17"
        assert page.locator("#t-rejected").inner_text() not in ("–", "0")
        assert "kv_high" in page.locator("#reasons").inner_text()
        assert "STALE" in page.locator("#node-summary").inner_text().upper()

        # The page stays responsive: re-sorting 64 rows takes effect at once.
        page.select_option("#sort", "name")
        page.wait_for_function(
            "document.querySelector('#node-rows tr.node').dataset.node === 'node-00'",
            timeout=WAIT_MS,
        )
        # Rendering keeps pace with the stream instead of falling behind it.
        counts = page.evaluate("({u: kvgate.updates, r: kvgate.renders})")
        assert counts["r"] >= counts["u"] // 2

        cluster.stale.clear()
        page.wait_for_function("kvgate.staleNodes().length === 0", timeout=WAIT_MS)
    assert page.kvgate_errors == []


def test_dashboard_says_when_the_gateway_goes_away(browser_page: Any) -> None:
    page = browser_page
    cluster = SyntheticCluster(2)
    with serve(router(cluster.state)) as url:
        page.goto(url + "/dashboard")
        page.wait_for_function("window.kvgate && kvgate.updates >= 2", timeout=WAIT_MS)
    # The server is gone: the connection badge must stop saying "live".
    page.wait_for_function(
        "document.getElementById('conn').textContent !== 'live'", timeout=WAIT_MS
    )
