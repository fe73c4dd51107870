"""Helpers for the real-engine tests: install, start and stop vLLM, read its metrics page.

They talk to the real vLLM CPU server over HTTP on 127.0.0.1 only, and every wait in here
is bounded in time, so a wedged engine fails a test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from kvgate.testing import free_port

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALLER = REPO_ROOT / "scripts" / "install-real-vllm.sh"
SERVE_SCRIPT = REPO_ROOT / "scripts" / "real-vllm" / "serve.sh"
MODEL_NAME = "tiny-llama"  # serve.sh's --served-model-name

# Measured figures, printed at the end of the session by conftest's terminal summary.
FIGURES: dict[str, str] = {}


def record_figure(name: str, value: str) -> None:
    """Keep a measured number so that the CI log shows it (see tests/real_engine/README.md)."""
    FIGURES[name] = value


def install_root() -> Path:
    """Where scripts/install-real-vllm.sh puts the engine (a cache outside the repo)."""
    explicit = os.environ.get("KVGATE_VLLM_ROOT")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvgate-vllm"


def is_installed() -> bool:
    """Fast check (no `import vllm`, which takes ~10 s) through the installer's --check."""
    result = subprocess.run(
        ["bash", str(INSTALLER), "--check"], capture_output=True, timeout=60, check=False
    )
    return result.returncode == 0


def run_installer(log_path: Path, timeout_s: float) -> tuple[bool, str]:
    """Run the installer once; returns (ok, tail of its output) for a skip or fail message."""
    with log_path.open("wb") as log:
        try:
            result = subprocess.run(
                ["bash", str(INSTALLER)],
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
            ok = result.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    return ok, tail(log_path)


def tail(path: Path, lines: int = 15, width: int = 240) -> str:
    """The last lines of a log file, each cut to `width`, for failure messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line if len(line) <= width else line[:width] + " ..." for line in text.splitlines()]
    return "\n".join(kept[-lines:])


# ---------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """A server started in its own process group, so that stopping it stops its children."""

    name: str
    url: str
    port: int
    proc: subprocess.Popen[bytes] | None  # None: started by someone else, not ours to stop
    log_path: Path

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the process group, wait, then SIGKILL whatever is left."""
        if self.proc is not None:
            stop_group(self.proc, grace_s)


def external_engine(url: str) -> ServerProcess:
    """An engine that the developer started (KVGATE_VLLM_URL); the tests never stop it."""
    port = int(url.rsplit(":", 1)[1])
    return ServerProcess("vLLM (external)", url, port, None, Path("/dev/null"))


def _die_with_parent() -> None:
    """In the child: get SIGTERM if pytest dies without tearing down (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(
    name: str, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start `argv` in a new session (its own process group), output to `log_path`."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=REPO_ROOT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
    return ServerProcess(name, f"http://127.0.0.1:{port}", port, proc, log_path)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Stop a process started with start_new_session=True by its id (its group's id)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while children (vLLM's engine core) linger: SIGKILL the group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def wait_ready(server: ServerProcess, path: str, timeout_s: float) -> None:
    """Poll `GET path` until 200; raise with the log's tail if it dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.name} exited with {server.proc.returncode} before it was ready; "
                    f"log {server.log_path}:\n{tail(server.log_path)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(server.url + path).status_code == 200:
                    return
            time.sleep(0.25)
    raise TimeoutError(
        f"{server.name} not ready after {timeout_s:.0f} s; log {server.log_path}:\n"
        f"{tail(server.log_path)}"
    )


def start_engine(log_path: Path, timeout_s: float) -> ServerProcess:
    """Start the repo's serve.sh on a free port and wait for /health."""
    port = free_port()
    env = {"KVGATE_VLLM_ROOT": str(install_root())}
    server = spawn("vLLM", ["bash", str(SERVE_SCRIPT), str(port)], port, log_path, env)
    try:
        wait_ready(server, "/health", timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


# ---------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineMetrics:
    """The few numbers of vLLM's metrics page that the tests look at."""

    running: float
    waiting: float
    kv_usage: float
    preemptions_total: float
    capacity_tokens: int | None
    prompt_tokens_total: float
    generation_tokens_total: float
    at: float = field(default=0.0, compare=False)  # time.monotonic() when the page arrived
    took: float = field(default=0.0, compare=False)  # how long the GET took (resolution)


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:generation_tokens_total": "generation_tokens_total",
}


def _labels(line: str) -> dict[str, str]:
    inner = line[line.index("{") + 1 : line.rindex("}")]
    out: dict[str, str] = {}
    for part in inner.split('",'):
        key, _, value = part.partition('="')
        out[key.strip()] = value.rstrip('"')
    return out


def parse_metrics(text: str, at: float = 0.0, took: float = 0.0) -> EngineMetrics:
    """Sum each wanted family over its label sets (one engine here); read KV capacity."""
    values = dict.fromkeys(_GAUGES.values(), 0.0)
    capacity: int | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _GAUGES:
            values[_GAUGES[name]] += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:cache_config_info":
            labels = _labels(line)
            capacity = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return EngineMetrics(capacity_tokens=capacity, at=at, took=took, **values)


async def read_metrics(client: httpx.AsyncClient, engine_url: str) -> EngineMetrics:
    sent = time.monotonic()
    response = await client.get(engine_url + "/metrics")
    response.raise_for_status()
    arrived = time.monotonic()
    return parse_metrics(response.text, arrived, arrived - sent)


async def poll(
    read: Callable[[], Awaitable[T]],
    condition: Callable[[T], bool],
    timeout_s: float,
    interval_s: float = 0.01,
) -> T:
    """Call `read()` every ~interval until `condition`; TimeoutError after timeout.

    A read that fails in transport is a missed poll, not a failure, since the reads here
    are idempotent GETs and the condition still has to be met within `timeout_s`. Seen: a
    CI run where vLLM's API server took over 10 s to accept a connection while the machine
    stalled, and a server that, resuming from a stall, closed a keep-alive connection
    whose idle timer had expired meanwhile, with the next GET already sent on it.
    """
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    failed: list[str] = []
    while time.monotonic() < deadline:
        try:
            last = await read()
        except httpx.TransportError as exc:
            failed.append(type(exc).__name__)
            continue
        if condition(last):
            return last
        await asyncio.sleep(interval_s)
    raise TimeoutError(
        f"condition not met in {timeout_s} s (failed reads: {failed or 'none'}); last {last}"
    )


async def poll_until(
    client: httpx.AsyncClient,
    engine_url: str,
    condition: Callable[[EngineMetrics], bool],
    timeout_s: float,
    interval_s: float = 0.01,
) -> EngineMetrics:
    """Poll the engine's metrics page until `condition` (see `poll`)."""
    return await poll(lambda: read_metrics(client, engine_url), condition, timeout_s, interval_s)


async def watch_until(
    client: httpx.AsyncClient,
    engine_url: str,
    condition: Callable[[EngineMetrics], bool],
    timeout_s: float,
    interval_s: float = 0.01,
    max_in_flight: int = 8,
) -> tuple[EngineMetrics, int]:
    """Start a metrics GET every `interval_s` without waiting for the previous one.

    Returns the first page to arrive that meets `condition`, and how many pages arrived.
    Unlike `poll_until`, a slow page does not delay the next poll, so the time at which
    a change is seen carries one GET's latency, not two.
    """
    found: asyncio.Future[EngineMetrics] = asyncio.get_running_loop().create_future()
    slots = asyncio.Semaphore(max_in_flight)
    pending: set[asyncio.Task[None]] = set()
    arrived = 0

    async def one() -> None:
        nonlocal arrived
        try:
            page = await read_metrics(client, engine_url)
        except httpx.HTTPError:
            return
        finally:
            slots.release()
        arrived += 1
        if not found.done() and condition(page):
            found.set_result(page)

    deadline = time.monotonic() + timeout_s
    try:
        while not found.done() and time.monotonic() < deadline:
            await slots.acquire()
            task = asyncio.create_task(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.wait({found}, timeout=interval_s)
        if not found.done():
            raise TimeoutError(f"engine condition not met in {timeout_s} s")
        return found.result(), arrived
    finally:
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def wait_idle(engine_url: str, timeout_s: float = 90.0) -> EngineMetrics:
    """Wait until the engine runs and queues nothing (earlier tests' requests are over)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        return await poll_until(
            client, engine_url, lambda m: m.running == 0 and m.waiting == 0, timeout_s, 0.05
        )


class MetricsRecorder:
    """Polls the metrics page in the background for the duration of an `async with`."""

    def __init__(self, engine_url: str, interval_s: float = 0.02) -> None:
        self.engine_url = engine_url
        self.interval_s = interval_s
        self.samples: list[EngineMetrics] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MetricsRecorder:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    self.samples.append(await read_metrics(client, self.engine_url))
                await asyncio.sleep(self.interval_s)


def thrashing_seen(samples: list[EngineMetrics], min_kv: float = 0.8) -> bool:
    """Preemption's live sign: running falls while waiting rises, with the KV cache nearly full.

    The preemptions counter lags (vLLM counts a preemption when the victim runs again), so
    the tests also look for this pattern in consecutive samples.
    """
    for before, after in itertools.pairwise(samples):
        if (
            after.running < before.running
            and after.waiting > before.waiting
            and max(before.kv_usage, after.kv_usage) >= min_kv
        ):
            return True
    return False


# ---------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------


async def exact_prompt(client: httpx.AsyncClient, engine_url: str, tokens: int) -> str:
    """A text prompt of exactly `tokens` tokens for the tiny model, checked by vLLM itself.

    " self" is one token of the tokenizer trained on Python sources; the engine's
    /tokenize endpoint confirms the count, so a tokenizer change fails loudly here.
    """
    prompt = " self" * tokens
    response = await client.post(
        engine_url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt}
    )
    response.raise_for_status()
    count = response.json()["count"]
    assert count == tokens, f"prompt of {tokens} x ' self' is {count} tokens for the engine"
    return prompt


async def exact_prompt_ids(client: httpx.AsyncClient, engine_url: str, tokens: int) -> list[int]:
    """The token ids of `exact_prompt(tokens)`: a prompt whose length kvgate counts exactly.

    kvgate estimates a text prompt's tokens from its characters (" self" is 5 of them for one
    token), so a text prompt near the context reads as longer than it is; ids are counted.
    """
    prompt = await exact_prompt(client, engine_url, tokens)
    response = await client.post(
        engine_url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt}
    )
    response.raise_for_status()
    ids = response.json()["tokens"]
    assert isinstance(ids, list) and len(ids) == tokens, ids
    return [int(i) for i in ids]
