"""`kvgate sim` as a user runs it: N engines, one URL line each, clean exit on SIGTERM."""

from __future__ import annotations

import json
import re
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


@pytest.mark.parametrize(
    "options, message",
    [
        (["--num-blocks", "1"], "num_blocks must be >= 2"),
        # Without the kv-events extra, the message names it instead.
        (["--kv-events-config", "{not json"], "--kv-events-config "),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
         "--kv-events-config"),
        (["--nodes", "3", "--kv-events-config", '{"enable_kv_cache_events": true, '
          '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5559"}'], "--kv-events-config"),
    ],
)  # fmt: skip
def test_sim_cli_rejects_bad_options(options: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvgate", "sim", *options],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and result.stderr.startswith("kvgate sim: ")
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_sim_cli_with_prefix_caching_publishes_each_engines_kv_events() -> None:
    zmq = pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvgate.adapters.vllm_kv_events import decode_batch
    from kvgate.core.prefix.events import AllBlocksCleared, BlockStored

    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:0", "topic": "kv"}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "sim", "--nodes", "2", "--port", "0",
         "--preset", "cpu-tiny", "--enable-prefix-caching",
         "--kv-events-config", json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    ctx = zmq.Context()
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        found = [re.search(r"(http://\S+) .*prefix caching True, KV events on (tcp://[^)]+)", x)
                 for x in lines]  # fmt: skip
        assert all(found), lines
        engines = [(m.group(1), m.group(2)) for m in found if m]
        assert engines[0][1] != engines[1][1]
        for i, (url, endpoint) in enumerate(engines):
            sub = ctx.socket(zmq.SUB)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            while True:  # a SUB socket misses what is sent before it has joined
                assert httpx.post(url + "/reset_prefix_cache", timeout=5).status_code == 200
                if sub.poll(200):
                    assert decode_batch(sub.recv_multipart()[2]).events == (AllBlocksCleared(),)
                    break
            prompt = list(range(100 * i, 100 * i + 64))  # two blocks of 32
            body = {"model": "sim-llama", "prompt": prompt, "max_tokens": 2}
            assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200
            assert sub.poll(10_000)
            (stored,) = decode_batch(sub.recv_multipart()[2]).events
            assert isinstance(stored, BlockStored) and list(stored.token_ids) == prompt
            assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
            sub.close(linger=0)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        ctx.term()
        if process.poll() is None:
            process.kill()
            process.wait()
