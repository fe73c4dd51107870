"""`kvgate status` against a real HTTP server serving `/admin/state`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opview_synthetic import SyntheticCluster, router, serve

from kvgate import status
from kvgate.cluster.redis_store import describe_error


def _cli(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvgate", "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, "COLUMNS": "160", "NO_COLOR": "1", **(env or {})},
        cwd=cwd,
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
    # Each node's ceiling and its reason.
    assert "92% recompute" in stale_line
    assert "392% overbooking" in next(line for line in out.splitlines() if "node-00" in line)
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
    assert "rejected by reason: kv_planned_peak" in out
    assert "Retry-After handed out" in out and "(mean " in out
    # The planned peak that refused the last request, where and against which ceiling.
    words = " ".join(out.split())
    assert (
        "last refused by the plan (standard, 0.4 s ago): node-04 planned 97% of its KV cache"
        " with it, over its 92% ceiling (its engine reported 88%)" in words
    )


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


def test_status_finds_the_gateway_where_serve_does(tmp_path: Path) -> None:
    """`--config` gives `server.listen` and `server.admin_token`; the environment beats the
    file and the flags beat both, as for `kvgate serve`."""
    cluster = SyntheticCluster(1)
    with serve(router(cluster.state, admin_token="s3cret")) as url:
        port = url.rpartition(":")[2]
        config = tmp_path / "kvgate.yaml"
        config.write_text(f"server: {{listen: '127.0.0.1:{port}', admin_token: s3cret}}\n")
        from_file = _cli("--config", "kvgate.yaml", cwd=tmp_path)
        wrong = tmp_path / "wrong.yaml"
        wrong.write_text("server: {listen: '127.0.0.1:9', admin_token: not-it}\n")
        by_flags = _cli("--config", str(wrong), "--port", port, "--admin-token", "s3cret")
        by_env = _cli(
            "--config", str(wrong), "--port", port, env={"KVGATE_SERVER__ADMIN_TOKEN": "s3cret"}
        )
        env_beats_file = _cli(
            "--config", str(wrong), env={"KVGATE_SERVER__LISTEN": f"127.0.0.1:{port}"}
        )
        bad_port = _cli("--port", "0")
    for done in (from_file, by_flags, by_env):
        assert done.returncode == 0, done.stdout + done.stderr
        assert "node-00" in done.stdout
    # The environment's listen beats the file's; the file's wrong token is then refused.
    assert env_beats_file.returncode == 1
    assert "the token given is not the gateway's server.admin_token" in env_beats_file.stdout
    assert bad_port.returncode == 2 and "--port" in bad_port.stdout


def test_a_gateway_without_an_admin_token_is_told_how_to_get_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With API keys and no admin token the gateway closes its views (403 admin_disabled):
    status repeats what it said and what to do, not a guess about a flag."""
    from kvgate.config import KvgateConfig
    from kvgate.gateway.app import Gateway

    config = KvgateConfig(
        backends=[{"url": "http://127.0.0.1:9"}],
        auth={"keys": [{"key": "k" * 32, "tenant": "team-a"}]},
    )
    with serve(Gateway(config)) as url:
        assert status.run(_args(url=url)) == 1
        assert status.run(_args(url=url, admin_token="anything")) == 1
    out = " ".join(capsys.readouterr().out.split())
    said = "answered 403 Forbidden: Admin routes are closed: set server.admin_token."
    assert out.count(f"{said} (admin_disabled)") == 2
    assert "set server.admin_token in its configuration" in out
    assert "pass --admin-token" not in out


def test_pids_are_whole_and_a_store_error_is_never_cut() -> None:
    error = describe_error(ConnectionError("Error 111 connecting to 127.0.0.1:6399." * 8))
    assert error.endswith("127.0.0.1:6399.") and len(error) > 200
    state = {
        "policy": {"nodes": {}, "controller": {}},
        "cluster": {
            "replicas": 2,
            "store": "redis://127.0.0.1:6399/0",
            "state": "isolated",
            "sync": {"last_error": error + " The end."},
            "members": [{"id": "a", "pid": 23812, "self": True}, {"id": "b", "pid": 23877}],
        },
    }
    console = status.Console(width=100, record=True)
    console.print(status.render(state))
    out = console.export_text()
    assert "23812" in out and "23877" in out and "23.8k" not in out
    assert (error + " The end.") in " ".join(out.replace("\n", " ").split())
