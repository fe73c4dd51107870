"""A metrics page that hangs and then answers again: kvgate admits again within one
`stale_after_s` of its recovery, because a poll out for `stale_after_s` is hedged with
another GET (the first one, lost in the hang, is never answered).

The fake engine's page loses every GET asked while it hangs (each stays unanswered until
its client hangs up), so only a GET sent after the recovery can answer: waiting for the
lost one would last until its hang bound (5 x `stale_after_s`). Meanwhile the node is only
late (kvgate.core.nodes): a request waits for its next sample, and is sent nowhere. The
hangs here end before that bound and after it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvgate.testing import FakeEngine, eventually

pytestmark = pytest.mark.timeout(60)

STALE_AFTER_S = 0.5
RECOVERY_BOUND_S = 1.0  # the target: requests pass again within 1 s of the page's return
BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


# Waiting for the lost GET until its hang bound would admit again only 1.35 s and 2.35 s
# after these recoveries. Both are shorter than the lag limit (10 x stale_after_s).
@pytest.mark.parametrize("hang", [1.2, 2.7], ids=["shorter-than-hang-bound", "longer"])
async def test_requests_pass_again_within_a_second_of_the_page_answering_again(
    gateway_factory, hang: float
) -> None:
    engine = await FakeEngine().start()
    try:
        gw = await gateway_factory(
            [engine.url],
            policy="adaptive",
            overrides={"admission.stale_after_s": STALE_AFTER_S},
        )
        node = f"127.0.0.1:{engine.port}"
        policy = gw.gateway.admission.policy
        scraper = gw.gateway.scraper

        def state() -> str:
            return str(gw.gateway.admission.snapshot()["nodes"][node]["state"])

        assert await eventually(lambda: node in policy.nodes and state() == "ok", 10)
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
            sent = len(engine.completions())
            engine.metrics_hung = True
            hung_at = time.monotonic()
            # Nothing is heard of the node: it is late, so a request waits for a sample.
            assert await eventually(lambda: state() == "stale", 5 * STALE_AFTER_S)
            assert gw.gateway.admission.snapshot()["nodes"][node]["late"]
            waiting = asyncio.create_task(client.post("/v1/completions", json=BODY))
            assert await eventually(lambda: time.monotonic() - hung_at >= hang, hang + 5)
            assert not waiting.done() and len(engine.completions()) == sent  # sent nowhere
            engine.metrics_hung = False
            back_at = time.monotonic()
            response = await waiting
            recovered_after = time.monotonic() - back_at
            page = (await client.get("/metrics")).text
        assert response.status_code == 200, response.text
        stats = scraper.stats()[node]
        assert recovered_after < RECOVERY_BOUND_S, (recovered_after, stats)
        assert stats.hedges_total >= 1, stats  # recovered through a hedge
        # ... and operators see it: the hedges are a counter per node.
        [hedges] = [
            line for line in page.splitlines() if line.startswith("kvgate_scrape_hedges_total{")
        ]
        assert f'node="{node}"' in hedges and float(hedges.split()[-1]) >= 1, hedges
    finally:
        await engine.stop()
