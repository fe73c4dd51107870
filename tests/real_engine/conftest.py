"""Fixtures for tests against the REAL vLLM CPU engine (marker `real_engine`).

One engine per test session (it takes 30-60 s to start and ~2 GB of memory), shared by
every test here; `idle_engine` waits until the previous test's requests are gone.

- The engine is installed once into a cache outside the repository by
  scripts/install-real-vllm.sh (reused by later runs). When that is impossible the tests
  SKIP with the installer's output, except under CI=true, where they FAIL: CI must
  exercise the real engine every time.
- `KVGATE_REAL_ENGINE=0` skips them on a developer machine (ignored in CI);
  `pytest -m "not real_engine"` does the same.
- `KVGATE_VLLM_URL=http://127.0.0.1:PORT` uses an engine you started yourself with
  scripts/real-vllm/serve.sh (not stopped at the end): quick iterations while developing.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from real_engine import engine as eng
from real_engine.load import BurstResult, burst

# Measured 30-60 s on 2 quiet cores, but over 3 minutes at a load average of 15 (other
# builds beside it): leave room. KVGATE_VLLM_START_TIMEOUT overrides it.
STARTUP_TIMEOUT_S = float(os.environ.get("KVGATE_VLLM_START_TIMEOUT", "360"))
INSTALL_TIMEOUT_S = 1800.0  # a cold install takes minutes (tests/real_engine/README.md)
HERE = Path(__file__).resolve().parent

# The overload burst: 16 x 500 prompt tokens, ignore_eos. 120 output tokens
# (cost 620 tokens, 20 blocks of 32) are enough: 7 such requests need 140 of the 128 KV
# blocks, so the engine must preempt; max_tokens 60 (18 blocks each, 126 for 7) measured
# none. Shorter than 1,000 output tokens, it keeps the burst to ~10 s.
BURST_N = 16
BURST_PROMPT_TOKENS = 500
BURST_MAX_TOKENS = 120

T = TypeVar("T")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _unavailable(message: str) -> None:
    """Skip locally, fail in CI."""
    if _in_ci():
        pytest.fail(f"real vLLM engine required in CI: {message}", pytrace=False)
    pytest.skip(f"real vLLM engine unavailable: {message}")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the budget goes to a test that runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark everything here `real_engine`; give the first test time to install and start."""
    ours = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.real_engine)
    if not ours:
        return
    # pytest-timeout counts fixture setup in the test that triggers it: the first test pays
    # for the engine's start (and, on a cold machine, its install), the rest do not.
    base = float(config.getini("timeout") or 120)
    marker = ours[0].get_closest_marker("timeout")
    if marker is not None and marker.args:
        base = float(marker.args[0])
    budget = base + STARTUP_TIMEOUT_S
    if not eng.is_installed():
        budget += INSTALL_TIMEOUT_S
    ours[0].add_marker(pytest.mark.timeout(budget), append=False)


@pytest.fixture(scope="session")
def vllm_installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The install root, installing the engine first if this machine has never had it."""
    if os.environ.get("KVGATE_REAL_ENGINE") == "0" and not _in_ci():
        pytest.skip("real vLLM engine tests disabled by KVGATE_REAL_ENGINE=0")
    if eng.is_installed():
        return eng.install_root()
    log_path = tmp_path_factory.mktemp("vllm-install") / "install.log"
    print(f"\ninstalling the real vLLM engine into {eng.install_root()} (log {log_path})")
    ok, output = eng.run_installer(log_path, INSTALL_TIMEOUT_S)
    if not ok or not eng.is_installed():
        _unavailable(f"scripts/install-real-vllm.sh failed; its output ends with:\n{output}")
    return eng.install_root()


@pytest.fixture(scope="session")
def vllm_engine(
    vllm_installed: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[eng.ServerProcess]:
    """ONE real vLLM server for the whole session, on a free loopback port."""
    external = os.environ.get("KVGATE_VLLM_URL")
    if external and not _in_ci():
        yield eng.external_engine(external.rstrip("/"))
        return
    log_path = tmp_path_factory.mktemp("vllm-engine") / "engine.log"
    server: eng.ServerProcess | None = None
    problem = ""
    try:
        server = eng.start_engine(log_path, STARTUP_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as exc:
        problem = str(exc)
    if server is None:
        # Installed but not startable is a real failure everywhere, never a skip.
        pytest.fail(f"the real vLLM engine did not start: {problem}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def idle_engine(vllm_engine: eng.ServerProcess) -> eng.ServerProcess:
    """The shared engine, once it runs and queues nothing (earlier tests are finished)."""
    assert vllm_engine.proc is None or vllm_engine.proc.poll() is None, (
        f"the vLLM engine died: {eng.tail(vllm_engine.log_path)}"
    )
    await eng.wait_idle(vllm_engine.url)
    return vllm_engine


GatewayFactory = Callable[..., eng.ServerProcess]


@pytest.fixture
def start_gateway(tmp_path: Path, idle_engine: eng.ServerProcess) -> Iterator[GatewayFactory]:
    """Start `python -m kvgate serve` in front of the real engine; stopped after the test."""
    started: list[eng.ServerProcess] = []

    def start(policy: str = "adaptive", **settings: str) -> eng.ServerProcess:
        """`settings` are config keys with `__` for nesting: scrape__interval_s="0.1"."""
        pytest.importorskip("kvgate.gateway.cli", reason="kvgate serve is not built yet")
        port = eng.free_port()
        env = {f"KVGATE_{key.upper()}": value for key, value in settings.items()}
        # kvgate's own policy is `kvgate serve`; a baseline runs in the benchmark's gateway.
        argv = [sys.executable, "-m", "kvgate", "serve"]
        if policy != "adaptive":
            argv = [sys.executable, "-m", "kvgate.bench.serve", "--baseline", policy]
        argv += [
            "--backend", idle_engine.url, "--port", str(port), "--log-level", "warning",
        ]  # fmt: skip
        log_path = tmp_path / f"kvgate-{policy}-{len(started)}.log"
        server = eng.spawn("kvgate", argv, port, log_path, env)
        started.append(server)
        # /readyz answers 200 once the scraper has a fresh sample of the engine.
        eng.wait_ready(server, "/readyz", timeout_s=30.0)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop(grace_s=10.0)


@pytest.fixture
async def engine_client() -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client for talking to the engine directly."""
    async with httpx.AsyncClient(timeout=60.0) as client:
        yield client


def run_in_thread(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Run a coroutine to completion in its own event loop, off the test's loop.

    Session-scoped results (the direct burst) are computed once and shared by tests that
    each have their own function-scoped loop; a worker thread keeps the two apart.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result(timeout=timeout_s)


async def _direct_burst(engine_url: str, prompt: str) -> BurstResult:
    await eng.wait_idle(engine_url)
    result = await burst(engine_url, engine_url, prompt, BURST_N, BURST_MAX_TOKENS)
    result.label = "direct"
    result.extra["max_tokens"] = BURST_MAX_TOKENS
    return result


@pytest.fixture(scope="session")
def burst_prompt(vllm_engine: eng.ServerProcess) -> str:
    """The burst's prompt: exactly BURST_PROMPT_TOKENS tokens for the engine."""

    async def make() -> str:
        async with httpx.AsyncClient(timeout=30.0) as client:
            return await eng.exact_prompt(client, vllm_engine.url, BURST_PROMPT_TOKENS)

    return run_in_thread(make(), 60.0)


@pytest.fixture(scope="session")
def direct_burst(vllm_engine: eng.ServerProcess, burst_prompt: str) -> BurstResult:
    """The overload burst sent straight to vLLM, once per session (~10 s), for comparison."""
    result = run_in_thread(_direct_burst(vllm_engine.url, burst_prompt), 150.0)
    name = f"burst {BURST_N} x ({BURST_PROMPT_TOKENS} + {BURST_MAX_TOKENS}) straight to vLLM"
    eng.record_figure(name, result.summary())
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the real-engine tests measured, so every CI log carries the figures."""
    if not eng.FIGURES:
        return
    terminalreporter.section("real vLLM engine: measured")
    for name, value in eng.FIGURES.items():
        terminalreporter.write_line(f"{name}: {value}")
