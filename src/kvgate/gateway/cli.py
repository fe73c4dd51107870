"""`kvgate serve`: run the gateway; with no backend, in front of the built-in simulator.

The quick start is `pip install . && kvgate serve`: when neither the config file, the
environment nor `--backend` names an engine, two simulated vLLM engines are started as a
child process on free ports (and stopped on exit) so that the gateway has something real
to protect.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from kvgate.children import die_with_parent, stop

log = logging.getLogger("kvgate.serve")

SIM_NODES = 2
SIM_PRESET = "cpu-tiny"
SIM_START_TIMEOUT_S = 60.0
_URL_RE = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="engine base URL (repeatable; a bare URL is a vLLM engine)",
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8080)")
    parser.add_argument(
        "--policy",
        choices=["none", "static-qps", "static-concurrency", "seed", "adaptive"],
        help="admission policy (default adaptive)",
    )
    parser.add_argument(
        "--server",
        choices=["uvicorn", "hypercorn"],
        help="uvicorn (HTTP/1.1, fastest) or hypercorn (HTTP/2: h2c, or h2 over TLS)",
    )
    parser.add_argument("--log-level", help="log level (default info)")
    parser.add_argument(
        "--store",
        metavar="URL",
        help="Redis the replicas share, to admit as one gateway"
        " (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="N processes sharing the port and a store (a private redis-server if no --store)",
    )
    # One of N workers started by --workers N: listen with SO_REUSEPORT.
    parser.add_argument("--as-worker", type=int, default=0, help=argparse.SUPPRESS)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "server.host": args.host,
        "server.port": args.port,
        "server.server": args.server,
        "server.log_level": args.log_level,
        "admission.policy": args.policy,
        "store.url": args.store,
    }
    if args.backend:
        overrides["backends"] = [{"url": url} for url in args.backend]
    return overrides


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kvgate.config import load_config

    if args.workers < 1:
        print("kvgate serve: --workers must be at least 1", file=sys.stderr)
        return 2
    overrides = _overrides(args)
    try:
        config = load_config(args.config, **overrides)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"kvgate serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    _setup_logging(config.server.log_level, config.server.access_log)
    sim: SimulatorProcess | None = None
    try:
        if not config.backends:
            sim = SimulatorProcess.start(SIM_NODES, SIM_PRESET)
            log.info(
                "no backend configured: started the built-in simulator (%d x %s) at %s",
                SIM_NODES,
                SIM_PRESET,
                ", ".join(sim.urls),
            )
            overrides["backends"] = [{"url": u} for u in sim.urls]
            config = load_config(args.config, **overrides)
        if args.workers > 1 and not args.as_worker:
            return _serve_workers(args, config, overrides)
        # What SIGHUP and /admin/reload re-read: the same file, environment and flags
        # (backends given with --backend, or the simulator's, stay as they are).
        return _serve(config, lambda: load_config(args.config, **overrides), args.as_worker)
    except SimulatorError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if sim is not None:
            sim.stop()


def _serve_workers(args: argparse.Namespace, config: Any, overrides: dict[str, Any]) -> int:
    """`--workers N`: this process supervises N `kvgate serve` workers (kvgate.cluster.workers)."""
    from kvgate.cluster.workers import serve_workers

    flags = {"--config": args.config, "--policy": args.policy, "--server": args.server,
             "--log-level": args.log_level}  # fmt: skip
    worker_args = [part for flag, value in flags.items() if value for part in (flag, value)]
    for backend in overrides.get("backends") or []:  # --backend, or the simulator's
        worker_args += ["--backend", backend["url"]]
    server = config.server
    return serve_workers(
        args.workers,
        worker_args,
        host=server.host,
        port=server.port,
        store_url=config.store.url,
        drain_timeout_s=server.drain_timeout_s,
    )


def _serve(config: Any, reread: Callable[[], Any], as_worker: int = 0) -> int:
    from kvgate.gateway.app import Gateway
    from kvgate.gateway.http.server import bind_socket, run_server
    from kvgate.gateway.relay.tokenizers import TokenizerLoadError

    server = config.server
    try:
        sock = bind_socket(server.host, server.port, reuse_port=as_worker > 0)
    except OSError as exc:
        print(f"kvgate serve: cannot listen on {server.host}:{server.port}: {exc}", file=sys.stderr)
        return 1
    try:
        gateway = Gateway(config, load_config=reread, replicas=max(1, as_worker))
    except TokenizerLoadError as exc:
        sock.close()
        print(f"kvgate serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    scheme = "https" if server.certfile and server.keyfile else "http"
    log.info(
        "kvgate listening on %s://%s:%d (%s, policy %s, %d backend(s): %s)",
        scheme,
        host,
        port,
        server.server,
        config.admission.policy,
        len(gateway.backends),
        ", ".join(b.node_id for b in gateway.backends),
    )
    run_server(gateway, sock)
    return 0


def _setup_logging(level: str, access_log: bool) -> None:
    from kvgate.gateway.ops.telemetry import BufferedLineWriter, set_access_writer

    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    access = logging.getLogger("kvgate.access")
    access.propagate = False
    access.setLevel(logging.CRITICAL + 1)  # lines go to the batched writer, or nowhere
    if access_log:
        sys.stderr.flush()
        writer = BufferedLineWriter(sys.stderr.fileno())
        set_access_writer(writer)
        atexit.register(writer.flush)


class SimulatorError(RuntimeError):
    """The built-in simulator could not be started."""


class SimulatorProcess:
    """`python -m kvgate sim` as a child process: started on free ports, stopped on exit."""

    def __init__(self, process: subprocess.Popen[str], urls: list[str]) -> None:
        self.process = process
        self.urls = urls

    @classmethod
    def start(
        cls, nodes: int, preset: str, timeout_s: float = SIM_START_TIMEOUT_S
    ) -> SimulatorProcess:
        # Port 0: every engine binds a free port and prints its URL once it accepts.
        command = [
            sys.executable, "-m", "kvgate", "sim",
            "--host", "127.0.0.1", "--port", "0", "--nodes", str(nodes), "--preset", preset,
        ]  # fmt: skip
        # Its own session: Ctrl-C reaches only the gateway, which drains and then stops
        # the simulator; on Linux the child also dies with the gateway if that is killed.
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        sim = cls(process, [])
        try:
            sim._wait_ready(nodes, timeout_s)
        except BaseException:
            sim.stop()
            raise
        return sim

    def _wait_ready(self, nodes: int, timeout_s: float) -> None:
        """One stdout line per ready engine; then each must answer `GET /health`."""
        lines: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                lines.append(line)
                sys.stderr.write(line)
            # keep draining so the child never blocks on a full pipe

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SimulatorError(
                    f"the simulator exited with code {self.process.returncode}"
                    " (is `kvgate sim` available?)"
                )
            urls = [m.group(0).rstrip("/") for m in map(_URL_RE.search, list(lines)) if m]
            if len(urls) >= nodes and all(_healthy(u) for u in urls[:nodes]):
                self.urls = urls[:nodes]
                return
            time.sleep(0.1)
        raise SimulatorError(f"the simulator was not ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        stop(self.process, timeout_s)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False
