"""`kvgate sim` as a user runs it: N engines, one URL line each, clean exit on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest


@pytest.mark.timeout(60)
def test_sim_cli_starts_n_engines_and_exits_cleanly_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "sim", "--nodes", "2", "--port", "0",
         "--preset", "gpu-8b", "--num-blocks", "1000", "--max-model-len", "8192",
         "--model-name", "m"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        urls = [line.split()[2] for line in lines]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), lines
        assert "1000 blocks x 16" in lines[0]
        for url in urls:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            models = httpx.get(url + "/v1/models", timeout=5).json()
            assert models["data"][0]["id"] == "m"
            page = httpx.get(url + "/metrics", timeout=5).text
            assert 'num_gpu_blocks="1000"' in page and 'sim_preset="gpu-8b"' in page
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sim_cli_rejects_bad_options() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvgate", "sim", "--num-blocks", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "kvgate sim:" in result.stderr
