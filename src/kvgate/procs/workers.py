"""`kvgate serve --workers N`: N gateway processes on one host, one port, one store.

One process is one core: Python runs a gateway's event loop on one. The supervisor (the
process the user started) starts N `kvgate serve` children that each listen on the same
port with SO_REUSEPORT, so the kernel spreads connections over them, and that share one
store, so they admit as one gateway (`kvgate.cluster`). With no store configured it starts
a private `redis-server` on a unix socket in a private directory (or says what it needs
when none is installed), starts it again if it dies (`RedisServer.revive`: the workers,
isolated meanwhile, find it empty and rejoin), and stops it on exit.

The supervisor owns its children: it holds the port for them (a bound, non-listening
SO_REUSEPORT socket, so a restarted worker gets the same port), forwards SIGTERM, SIGINT
and SIGHUP to every worker (they drain and reload as one `kvgate serve` does), restarts a
worker that dies while serving (or is killed), and gives up, stopping the others, when a
worker exits with an error as it starts (a configuration the workers refuse is not retried
in a loop). Workers run in sessions of their own, so Ctrl-C in a terminal reaches the
supervisor once and it tells each worker once; and each dies with the supervisor if that
is killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

from kvgate.cluster.urls import redact
from kvgate.procs.children import die_with_parent
from kvgate.procs.redis_server import RedisServer, RedisServerUnavailable, find_redis_server

log = logging.getLogger("kvgate.workers")

#: A worker that exits with an error code sooner than this after its start failed to start
#: (killed by a signal, it crashed: it is restarted).
_START_GRACE_S = 10.0
_RESTART_DELAY_S = 1.0
_POLL_S = 0.1
#: After the drain: how long workers may take to exit before they are killed.
_EXIT_GRACE_S = 10.0

NEEDS_STORE = (
    "kvgate serve --workers N needs a store the workers share: pass --store"
    " redis://HOST:PORT/DB (or set store.url / KVGATE_STORE__URL), or install redis-server"
    " (Debian/Ubuntu: apt-get install redis-server) and kvgate starts a private one."
)


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Runs `count` workers with `command` (a `kvgate serve` command line without the
    port) on `host:port` until a signal stops them."""

    def __init__(
        self,
        command: Sequence[str],
        count: int,
        host: str,
        port: int,
        drain_timeout_s: float,
        env: dict[str, str],
        store: RedisServer | None = None,
    ) -> None:
        self.command = list(command)
        self.store = store  # the private redis-server, kept alive while the workers run
        self.env = env
        self.count = count
        self.host = host
        self.port = port
        self.drain_timeout_s = drain_timeout_s
        self.workers: list[_Worker] = []
        self._signals: list[int] = []
        self._stopping = False

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        }
        try:
            self.workers = [self._spawn(i) for i in range(self.count)]
            log.info(
                "%d workers on %s:%d (pids %s)",
                self.count,
                self.host,
                self.port,
                ", ".join(str(w.process.pid) for w in self.workers),
            )
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all(signal.SIGTERM)

    def _spawn(self, index: int) -> _Worker:
        process = subprocess.Popen(
            [*self.command, "--port", str(self.port)],
            env=self.env,
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        return _Worker(index, process)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _supervise(self) -> int:
        while True:
            while self._signals:
                self._forward(self._signals.pop(0))
            if self._stopping and all(w.process.poll() is not None for w in self.workers):
                return 0
            if self.store is not None and not self._stopping:
                self.store.revive()
            for worker in self.workers:
                code = worker.process.poll()
                if code is None or self._stopping:
                    continue
                ran = time.monotonic() - worker.started_at
                if code > 0 and ran < _START_GRACE_S:  # refused to start; a signal is a crash
                    log.error("worker %d failed as it started (exit code %d)", worker.index, code)
                    self._stop_all(signal.SIGTERM)
                    return code
                log.warning(
                    "worker %d (pid %d) exited with code %d after %.0f s: restarting it",
                    worker.index,
                    worker.process.pid,
                    code,
                    ran,
                )
                time.sleep(_RESTART_DELAY_S)
                self.workers[worker.index] = self._spawn(worker.index)
            time.sleep(_POLL_S)

    def _forward(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            if not self._stopping:
                log.info("stopping %d workers", len(self.workers))
            self._stopping = True
        for worker in self.workers:
            if worker.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    def _stop_all(self, signum: int) -> None:
        """Signal every live worker and wait for them (bounded); kill what is left."""
        live = [w for w in self.workers if w.process.poll() is None]
        for worker in live:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signum)
        deadline = time.monotonic() + self.drain_timeout_s + _EXIT_GRACE_S
        for worker in live:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop: killing it", worker.index)
                worker.process.kill()
                worker.process.wait()


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket: holds `port` (0: a free one) for the
    workers, which bind it too; it never accepts a connection itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_workers(
    count: int,
    worker_args: Sequence[str],
    *,
    host: str,
    port: int,
    store_url: str | None,
    drain_timeout_s: float,
) -> int:
    """Start the store if needed, hold the port, run the workers; the exit code."""
    redis: RedisServer | None = None
    if store_url is None:
        if find_redis_server() is None:
            print(f"kvgate serve: {NEEDS_STORE}", file=sys.stderr)
            return 2
        try:
            redis = RedisServer.start(port=None)
        except RedisServerUnavailable as exc:
            print(f"kvgate serve: cannot start a private redis-server: {exc}", file=sys.stderr)
            return 1
        store_url = redis.url
        log.info("started a private redis-server on %s", redis.socket_path)
    try:
        try:
            held = reserve_port(host, port)
        except OSError as exc:
            print(f"kvgate serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            return 1
        with held:
            port = held.getsockname()[1]
            command = [
                sys.executable, "-m", "kvgate", "serve", *worker_args,
                "--host", host, "--as-worker", str(count),
            ]  # fmt: skip
            # The URL goes by the environment: a password on a command line is public.
            env = {**os.environ, "KVGATE_STORE__URL": store_url}
            private = "" if redis is None else " (private)"
            log.info("workers share the store %s%s", redact(store_url), private)
            return Supervisor(command, count, host, port, drain_timeout_s, env, redis).run()
    finally:
        if redis is not None:
            redis.stop()
