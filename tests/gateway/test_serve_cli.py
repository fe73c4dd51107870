"""`kvgate serve` as a user meets it: its help, its logs, the simulator's size, TLS and
metrics flags, and what `--backend` does to the file's backends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.helpers import access_lines, kvgate_serve, until_ready
from kvgate.testing import FakeEngine, free_port

pytestmark = pytest.mark.timeout(90)

TEXT_LINE = re.compile(rb"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")


def _kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgate", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_and_the_help_that_answers_a_newcomers_questions() -> None:
    version = _kvgate("--version")
    assert version.returncode == 0 and re.fullmatch(r"kvgate \d+\.\d+\.\d+\S*\n", version.stdout)
    text = _kvgate("serve", "--help").stdout
    flat = " ".join(text.split())
    assert "replaces the backends of the config file and the environment" in flat
    assert "KVGATE_<SECTION>__<KEY>" in text and "kvgate config-doc" in text
    for flag in ("--sim-nodes", "--sim-preset", "--certfile", "--keyfile", "--log-format"):
        assert flag in text
    assert "--metrics-listen" in text


async def test_json_logs_metrics_address_and_backend_flag(
    fake_engine: FakeEngine, tmp_path: Path
) -> None:
    (tmp_path / "kvgate.yaml").write_text(
        "backends: [http://10.255.0.1:8000, http://10.255.0.2:8000]\n"
    )
    metrics = f"127.0.0.1:{free_port()}"
    args = ("--config", "kvgate.yaml", "--backend", fake_engine.url)
    args += ("--log-format", "json", "--metrics-listen", metrics)
    async with kvgate_serve(*args, cwd=tmp_path) as served:
        async with httpx.AsyncClient(base_url=served.url) as client:
            assert await until_ready(client)
            ok = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "p"})
            unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "p"})
            hidden = await client.get("/metrics")
            scraped = await client.get(f"http://{metrics}/metrics")
            only_metrics = await client.get(f"http://{metrics}/v1/models")
            dashboard = await client.get("/dashboard")
        # The start-up line's `kvgate status` command, run as printed, reads this gateway.
        port = served.url.rpartition(":")[2]
        command = f"kvgate status --config kvgate.yaml --port {port}"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        status = await asyncio.create_subprocess_exec(
            sys.executable, "-m", *command.split(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
            env={**clean, "NO_COLOR": "1", "COLUMNS": "160"},
        )  # fmt: skip
        status_out = (await asyncio.wait_for(status.communicate(), 60))[0].decode()
    assert served.returncode == 0, served.stderr.decode()
    assert dashboard.status_code == 200
    assert status.returncode == 0 and "policy adaptive" in status_out, status_out
    assert (ok.status_code, unknown.status_code) == (200, 404)
    assert hidden.status_code == 404 and only_metrics.status_code == 404
    assert scraped.status_code == 200 and b"kvgate_requests_total" in scraped.content
    lines = [orjson.loads(line) for line in served.stderr.splitlines()]  # every line JSON
    assert all({"time", "level", "logger"} <= set(line) for line in lines)
    loggers = {line["logger"] for line in lines}
    assert {"kvgate.serve", "uvicorn.error", "kvgate.access"} <= loggers
    listening = next(line["message"] for line in lines if "listening on" in line.get("message", ""))
    assert "1 backend(s) from --backend, in place of the configuration's 2" in listening
    assert listening.endswith(f"; pid {served.process.pid})")
    assert f"dashboard: {served.url}/dashboard; in a terminal: {command}" in [
        line.get("message") for line in lines
    ]
    assert [(a["status"], a["reason"]) for a in access_lines(served.stderr)] == [
        (200, None),
        (404, "model_not_found"),
    ]


async def test_text_logs_tls_flags_and_a_simulator_of_chosen_size(
    tmp_path: Path, self_signed: tuple[Path, Path]
) -> None:
    cert, key = self_signed
    args = ("--sim-nodes", "1", "--sim-preset", "gpu-8b", "--certfile", str(cert))
    args += ("--keyfile", str(key))
    async with kvgate_serve(*args, cwd=tmp_path, stop_within=20.0) as served:
        url = served.url.replace("http://", "https://")
        trust = ssl.create_default_context(cafile=cert)
        async with httpx.AsyncClient(base_url=url, verify=trust, timeout=10) as client:
            assert await until_ready(client, within=30.0)
            ready = (await client.get("/readyz")).json()
            models = (await client.get("/v1/models")).json()["data"]
    assert served.returncode == 0, served.stderr.decode()
    assert len(ready["backends"]) == 1
    assert models[0]["max_model_len"] == 131_072  # the gpu-8b preset
    log = served.stderr
    assert b"started the built-in simulator (1 x gpu-8b)" in log
    assert b"kvgate listening on https://" in log
    assert all(TEXT_LINE.match(line) for line in log.splitlines()), log.decode()


async def test_an_embedded_gateway_binds_its_metrics_address_itself(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    gw = await gateway_factory([fake_engine.url], overrides={"server.metrics_listen": metrics})
    async with httpx.AsyncClient() as client:
        hidden = await client.get(gw.url + "/metrics")
        scraped = await client.get(f"http://{metrics}/metrics")
        refused = await client.post(f"http://{metrics}/metrics")
    assert hidden.status_code == 404
    assert scraped.status_code == 200 and b"kvgate_requests_in_flight" in scraped.content
    assert refused.status_code == 405
    gw.server.stop()
    await gw.task
    with pytest.raises(httpx.ConnectError):  # the metrics server stops with the gateway
        async with httpx.AsyncClient() as client:
            await client.get(f"http://{metrics}/metrics")


async def test_an_ipv6_listen_with_the_port_flag(fake_engine: FakeEngine, tmp_path: Path) -> None:
    """`server.listen` names an IPv6 address in brackets; `--port` (the helper's) replaces
    only its port, and the start-up line shows the address as a URL."""
    (tmp_path / "kvgate.yaml").write_text(
        f"server: {{listen: '[::1]:1'}}\nbackends: [{fake_engine.url}]\n"
    )
    async with kvgate_serve("--config", "kvgate.yaml", cwd=tmp_path) as served:
        port = served.url.rpartition(":")[2]
        async with httpx.AsyncClient(base_url=f"http://[::1]:{port}") as client:
            assert await until_ready(client)
            body = {"model": "fake-model", "prompt": "p"}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    assert f"kvgate listening on http://[::1]:{port} ".encode() in served.stderr


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux: /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _importing_pydantic(pid: int) -> bool:
    """kvgate has begun reading its configuration model (pydantic's library is mapped)."""
    try:
        return "pydantic_core" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited, not yet reaped by its new parent


@pytest.mark.skipif(sys.platform != "linux", reason="watches the process through /proc")
@pytest.mark.parametrize("moment", ["while it imports", "while the simulator starts"])
def test_ctrl_c_while_kvgate_starts_exits_quietly_with_130(moment: str, tmp_path: Path) -> None:
    """Ctrl-C before the server handles signals (it drains then) is a quiet exit, status
    130, with no traceback; the simulator it was starting is stopped too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
        # A terminal's Ctrl-C reaches a process whose SIGINT is not ignored (as it is for
        # a background job of a shell that started pytest).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60.0
        children: list[int] = []
        while time.monotonic() < deadline and process.poll() is None:
            children = _children(process.pid)
            started = children if moment == "while the simulator starts" else None
            if started or (started is None and _importing_pydantic(process.pid)):
                break
            time.sleep(0.002)
        assert process.poll() is None, "kvgate serve exited by itself"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    deadline = time.monotonic() + 10.0
    while not all(_gone(child) for child in children) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_gone(child) for child in children), "the simulator lives on"
