"""`kvgate status` against a real HTTP server serving `/admin/state`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
from opview_synthetic import SyntheticCluster, router, serve

from kvgate import status


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    env.pop("KVGATE_SERVER__ADMIN_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "kvgate", "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    status.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_status_prints_every_node_and_flags_the_stale_one() -> None:
    cluster = SyntheticCluster(5)
    cluster.overload = True
    cluster.stale.add("node-03")
    cluster.full_page.add("node-01")
    with serve(router(cluster.state)) as url:
        result = _cli("--url", url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "policy adaptive" in out
    for node in cluster.ids:
        assert node in out
    stale_line = next(line for line in out.splitlines() if "node-03" in line)
    assert "STALE" in stale_line
    # A node the scraper keeps on the full metrics page says so; the others do not.
    assert [line for line in out.splitlines() if "(full page)" in line] == [
        next(line for line in out.splitlines() if "node-01" in line)
    ]
    # Worst first: the stale node is listed before the merely high ones.
    assert out.index("node-03") < out.index("node-00")
    # The overload shows in the gateway's queue: waiting per priority and in total.
    queue_line = next(line for line in out.splitlines() if "waiting in queue" in line)
    assert [cell for cell in queue_line.replace("│", " ").split() if cell.isdigit()] == [
        "0",
        "40",
        "25",
        "65",
    ]
    assert "rejected by reason: kv_high" in out
    assert "Retry-After handed out" in out and "(mean " in out


def test_status_sends_the_admin_token(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = SyntheticCluster(1)
    with serve(router(cluster.state, admin_token="s3cret")) as url:
        refused = status.run(_args(url=url, admin_token=None))
        refused_out = capsys.readouterr().out
        accepted = status.run(_args(url=url, admin_token="s3cret"))
        accepted_out = capsys.readouterr().out
    assert refused == 1
    assert "401" in refused_out and "--admin-token" in refused_out
    assert accepted == 0 and "node-00" in accepted_out


def test_unreachable_gateway_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert status.run(_args(url="http://127.0.0.1:9", timeout=1.0)) == 1
    assert "cannot reach the gateway" in capsys.readouterr().out


def test_watch_adds_rates(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = SyntheticCluster(2)
    cluster.overload = True
    with serve(router(cluster.state)) as url:
        code = status.run(_args(url=url, watch=True, count=3, interval=0.3))
    assert code == 0
    out = capsys.readouterr().out
    assert "admitted /s" in out and "rejected /s" in out


def test_json_output_is_the_raw_state(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = SyntheticCluster(2)
    with serve(router(cluster.state)) as url:
        assert status.run(_args(url=url, json=True)) == 0
    assert '"node-01"' in capsys.readouterr().out


def test_bad_arguments_are_refused() -> None:
    assert status.run(_args(interval=0, watch=True)) == 2
    assert status.run(_args(count=0, watch=True)) == 2


def test_rates_come_from_counter_deltas_and_reset_on_restart() -> None:
    def state(admit: int, reject: int, cancels: int) -> dict[str, object]:
        return {
            "counters": {
                "admissions": {
                    "admit|standard|ok": admit,
                    "reject|sheddable|kv_high": reject,
                },
                "cancellations": {"streaming": cancels},
            }
        }

    first = status.totals(state(10, 4, 1), at=100.0)
    second = status.totals(state(30, 10, 3), at=102.0)
    per_second = status.rates(first, second)
    assert per_second is not None
    assert per_second["admitted_standard"] == pytest.approx(10.0)
    assert per_second["rejected_sheddable"] == pytest.approx(3.0)
    assert per_second["cancellations"] == pytest.approx(1.0)
    assert status.rates(None, second) is None
    restarted = status.totals(state(1, 0, 0), at=103.0)
    assert status.rates(second, restarted) is None


def test_status_reads_a_real_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    """Against kvgate's own /admin/state (nested policy snapshot, gateway counters)."""
    from kvgate.config import KvgateConfig
    from kvgate.gateway.app import Gateway

    config = KvgateConfig(backends=[{"url": "http://127.0.0.1:9", "name": "engine-a"}])
    with serve(Gateway(config)) as url:
        assert status.run(_args(url=url)) == 0
    out = capsys.readouterr().out
    assert "policy adaptive" in out
    assert "engine-a" in out


def test_watch_redirected_to_a_file_writes_each_frame_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`kvgate status --watch > file` (no --count: stopped from outside, as a user does)."""
    cluster = SyntheticCluster(2)
    out = tmp_path / "status.txt"
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("KVGATE_SERVER__ADMIN_TOKEN", None)
    with serve(router(cluster.state)) as url, out.open("w") as sink:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "status", "--watch", "--url", url, "--interval=0.2"],
            stdout=sink,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            deadline = time.monotonic() + 20
            while out.read_text().count("policy adaptive") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            frames = out.read_text().count("policy adaptive")
        finally:
            watcher.terminate()
            watcher.wait(10)
    assert frames >= 2, out.read_text()
