"""The chaos soak in CI: a real kvgate process, failing engines, misbehaving clients.

About a minute of traffic (`KVGATE_SOAK_SECONDS`, default 60) from 24 workers against
three simulated engines that crash, restart, stall, reset connections and hang or garble
their metrics every ~0.4 s on average; a quarter of the requests are cancelled at random
points and one in seven is malformed. On these 2-core machines that is 4,000-9,000
requests depending on their load (the report printed below says exactly how many).
`benchmarks/soak/run_soak.py` runs the longer version and writes its figures to
`benchmarks/soak/results.md`.
"""

from __future__ import annotations

import os

import pytest

from kvgate.testing.soak import run_soak
from kvgate.testing.soak_report import SoakSettings, summary

SECONDS = float(os.environ.get("KVGATE_SOAK_SECONDS", "60"))


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 150)
async def test_chaos_soak_leaves_nothing_behind(tmp_path) -> None:
    settings = SoakSettings(
        duration_s=SECONDS,
        warmup_s=4.0,
        workers=24,
        fault_interval_s=0.4,
        rss_growth_bound_mib=32.0,
        gateway_log=str(tmp_path / "gateway.log"),
    )
    report = await run_soak(settings)
    print(summary(report))
    assert not report.violations, "\n".join(report.violations[:20])
    assert report.leaks_found == 0, report.leaks
    assert report.log_errors == 0, (tmp_path / "gateway.log").read_text()[-5000:]
    assert report.still_serves
    assert report.rss_growth_mib <= settings.rss_growth_bound_mib
    # The run did what it claims: traffic of every kind, faults of every kind.
    assert report.requests >= 20 * SECONDS
    assert report.statuses["200"] > 0 and report.cancellations > 0
    for kind in ("crash", "restart", "metrics_hang", "metrics_garbage", "reset_connections"):
        assert report.faults[kind] > 0, report.faults
