"""`kvgate serve`: run the gateway; with no backend, in front of the built-in simulator.

The quick start is `pip install . && kvgate serve`: when neither the config file, the
environment nor `--backend` names an engine, two simulated vLLM engines are started as a
child process on free ports (and stopped on exit) so that the gateway has something real
to protect.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

from kvgate.procs.children import die_with_parent, stop

if TYPE_CHECKING:
    from kvgate.core.clock import Clock
    from kvgate.core.policies.base import BasePolicy
    from kvgate.core.settings import AdmissionSettings

    #: Builds a placement on the gateway's clock (see `run`).
    PolicyFactory = Callable[[AdmissionSettings, Clock], BasePolicy]

log = logging.getLogger("kvgate.serve")

SIM_NODES = 2
SIM_PRESET = "cpu-tiny"
SIM_START_TIMEOUT_S = 60.0
_URL_RE = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")

EPILOG = """\
settings: every configuration key can be set in the YAML file (--config) or in the
environment as KVGATE_<SECTION>__<KEY>, e.g. KVGATE_SERVER__ADMIN_TOKEN=...,
KVGATE_SCRAPE__INTERVAL_S=0.1, KVGATE_BACKENDS='["http://gpu-1:8000"]'; the flags above
set the most common ones. Flags beat the environment, which beats the file.
`kvgate config-doc` lists every key with its default and meaning.

Without any backend (no --backend, none in the file or the environment) kvgate starts
the built-in engine simulator (--sim-nodes x --sim-preset) and stops it on exit.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvgate.sim.presets import PRESETS  # light: no aiohttp

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="FILE", help="YAML config file")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="engine base URL (repeatable; a bare URL is a vLLM engine); replaces the"
        " backends of the config file and the environment",
    )
    parser.add_argument(
        "--host", help="address to listen on: the host of server.listen (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, help="port to listen on: the port of server.listen (default 8080)"
    )
    parser.add_argument(
        "--server",
        choices=["uvicorn", "hypercorn"],
        help="uvicorn (HTTP/1.1, the cheapest) or hypercorn (HTTP/2 as well: h2c, or h2 over TLS)",
    )
    parser.add_argument("--certfile", metavar="FILE", help="TLS certificate (PEM): serve HTTPS")
    parser.add_argument("--keyfile", metavar="FILE", help="TLS private key (PEM)")
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve /metrics on this address only (e.g. 0.0.0.0:9464), not on the main one",
    )
    parser.add_argument(
        "--log-level",
        help="debug, info, warning, error or critical (default info; access lines are info)",
    )
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="log lines as text (default) or as one JSON object each",
    )
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
    parser.add_argument(
        "--sim-nodes",
        type=_count,
        default=SIM_NODES,
        metavar="N",
        help=f"built-in simulator: engines to start (default {SIM_NODES})",
    )
    parser.add_argument(
        "--sim-preset",
        choices=sorted(PRESETS),
        default=SIM_PRESET,
        help=f"built-in simulator: engine model (default {SIM_PRESET})",
    )


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1: {text!r}")
    return int(text)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "server.server": args.server,
        "server.certfile": args.certfile,
        "server.keyfile": args.keyfile,
        "server.metrics_listen": args.metrics_listen,
        "server.log_level": args.log_level,
        "server.log_format": args.log_format,
        "store.url": args.store,
    }
    if args.backend:
        overrides["backends"] = [{"url": url} for url in args.backend]
    return overrides


def _listen_flags(args: argparse.Namespace) -> str | None:
    """`--host` and `--port` as `server.listen`; a half not given is the configured one."""
    from kvgate.config import load_config
    from kvgate.gateway.settings import join_address

    host, port = args.host, args.port
    if host is None and port is None:
        return None
    if host is None or port is None:
        configured_host, configured_port = load_config(args.config).server.address
        host = configured_host if host is None else host
        port = configured_port if port is None else port
    return join_address(host, port)


def run(args: argparse.Namespace, policy: PolicyFactory | None = None) -> int:
    """`kvgate serve ARGS`; `policy` builds the gateway's placement in place of kvgate's
    (`kvgate.bench.serve` runs the benchmark's baselines with it)."""
    from kvgate.config import ConfigError, load_config
    from kvgate.gateway.ops.logs import setup_logging

    if args.workers < 1:
        print("kvgate serve: --workers must be at least 1", file=sys.stderr)
        return 2
    if policy is not None and args.workers > 1:
        print("kvgate serve: a baseline policy runs in one process (no --workers)", file=sys.stderr)
        return 2
    overrides = _overrides(args)
    try:
        overrides["server.listen"] = _listen_flags(args)
        config = load_config(args.config, **overrides)
        # --backend replaces the backends the file and the environment name: say so.
        replaced = len(load_config(args.config).backends) if args.backend else 0
        _check_tls(config.server.certfile, config.server.keyfile)
    except ConfigError as exc:
        print(f"kvgate serve: invalid configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.server.log_level, config.server.log_format)
    origin = f" from --backend, in place of the configuration's {replaced}" if replaced else ""
    sim: SimulatorProcess | None = None
    try:
        if not config.backends:
            sim = SimulatorProcess.start(args.sim_nodes, args.sim_preset)
            log.info(
                "no backend configured: started the built-in simulator (%d x %s) at %s",
                args.sim_nodes,
                args.sim_preset,
                ", ".join(sim.urls),
            )
            overrides["backends"] = [{"url": u} for u in sim.urls]
            config = load_config(args.config, **overrides)
        if args.workers > 1 and not args.as_worker:
            return _serve_workers(args, config, overrides)
        # What SIGHUP and /admin/reload re-read: the same file, environment and flags
        # (backends given with --backend, or the simulator's, stay as they are).
        return _serve(
            config,
            lambda: load_config(args.config, **overrides),
            args.as_worker,
            origin,
            args.config,
            policy,
        )
    except SimulatorError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if sim is not None:
            sim.stop()


def _serve_workers(args: argparse.Namespace, config: Any, overrides: dict[str, Any]) -> int:
    """`--workers N`: this process supervises N `kvgate serve` workers (kvgate.procs.workers)."""
    from kvgate.procs.workers import serve_workers

    flags = {"--config": args.config, "--server": args.server,
             "--log-level": args.log_level, "--log-format": args.log_format,
             "--certfile": args.certfile, "--keyfile": args.keyfile,
             "--metrics-listen": args.metrics_listen}  # fmt: skip
    worker_args = [part for flag, value in flags.items() if value for part in (flag, value)]
    for backend in overrides.get("backends") or []:  # --backend, or the simulator's
        worker_args += ["--backend", backend["url"]]
    server = config.server
    host, port = server.address
    return serve_workers(
        args.workers,
        worker_args,
        host=host,
        port=port,
        store_url=config.store.url,
        drain_timeout_s=server.drain_timeout_s,
    )


def _serve(
    config: Any,
    reread: Callable[[], Any],
    as_worker: int = 0,
    origin: str = "",
    config_path: str | None = None,
    policy: PolicyFactory | None = None,
) -> int:
    from kvgate.core.clock import MonotonicClock
    from kvgate.gateway.app import Gateway
    from kvgate.gateway.http.server import bind_socket, run_server
    from kvgate.gateway.settings import join_address, listen_address, local_url
    from kvgate.gateway.tokens.files import TokenizerLoadError

    server = config.server
    sockets = []
    try:
        addresses = [server.address]
        if server.metrics_listen:
            addresses.append(listen_address(server.metrics_listen))
        for host, port in addresses:
            try:
                # Workers share both ports (SO_REUSEPORT): the kernel picks one per connection.
                sockets.append(bind_socket(host, port, reuse_port=as_worker > 0))
            except OSError as exc:
                print(f"kvgate serve: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
                return 1
        try:
            clock = MonotonicClock()
            gateway = Gateway(
                config,
                policy=None if policy is None else policy(config.admission, clock),
                clock=clock,
                load_config=reread,
                replicas=max(1, as_worker),
            )
        except (TokenizerLoadError, ValueError) as exc:
            print(f"kvgate serve: invalid configuration: {exc}", file=sys.stderr)
            return 2
        tls = bool(server.certfile and server.keyfile)
        host, port = sockets[0].getsockname()[:2]
        log.info(
            "kvgate listening on %s://%s (%s, policy %s, %d backend(s)%s: %s; pid %d)",
            "https" if tls else "http",
            join_address(host, port),
            server.server,
            gateway.admission.policy.name,
            len(gateway.backends),
            origin,
            ", ".join(b.node_id for b in gateway.backends),
            os.getpid(),
        )
        url = local_url(host, port, tls=tls)
        log.info(
            "dashboard: %s/dashboard; in a terminal: %s", url, _status_command(url, config_path)
        )
        metrics_sock = sockets[1] if len(sockets) > 1 else None
        if metrics_sock is not None:
            log.info("metrics on http://%s/metrics", join_address(*metrics_sock.getsockname()[:2]))
        run_server(gateway, sockets[0], metrics_sock=metrics_sock)
        return 0
    finally:
        for sock in sockets:
            sock.close()


def _status_command(url: str, config_path: str | None) -> str:
    """The `kvgate status` that reaches the gateway at `url` from this host: it reads the
    same file and environment, so only what the flags changed is said again."""
    from kvgate.config import load_config
    from kvgate.gateway.settings import local_url

    words = ["kvgate status"]
    if config_path:
        words += ["--config", config_path]
    server = load_config(config_path).server
    host, port = server.address
    configured = local_url(host, port, tls=bool(server.certfile and server.keyfile))
    if url != configured:
        same_host = url.rpartition(":")[0] == configured.rpartition(":")[0]
        words += ["--port", url.rpartition(":")[2]] if same_host else ["--url", url]
    return " ".join(words)


def _check_tls(certfile: str | None, keyfile: str | None) -> None:
    """Load the certificate and key once before serving: a file that cannot be read (named)
    or a key that does not match is a configuration error, said plainly, not a traceback
    from the server."""
    from kvgate.config import ConfigError

    if not (certfile and keyfile):
        return
    for key, path in (("server.certfile", certfile), ("server.keyfile", keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS: {certfile} with {keyfile}: {exc}") from None


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
        # Its output goes through the gateway's logging (one format for the whole stream).
        sim: SimulatorProcess | None = None
        try:
            with _sigint_held():
                process = subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                    preexec_fn=_in_child,
                )
                sim = cls(process, [])
            sim._wait_ready(nodes, timeout_s)
        except BaseException:
            if sim is not None:
                sim.stop()
            raise
        return sim

    def _wait_ready(self, nodes: int, timeout_s: float) -> None:
        """One stdout line per ready engine; then each must answer `GET /health`."""
        lines: list[str] = []
        assert self.process.stdout is not None and self.process.stderr is not None
        _forward(self.process.stdout, logging.INFO, lines)
        _forward(self.process.stderr, logging.WARNING)
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


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold SIGINT back while a child is forked; a Ctrl-C meanwhile arrives just after.

    Python runs handlers around a fork (logging releases its lock in one): a Ctrl-C raised
    inside one leaves that lock held, and the exit that follows hangs on it.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _in_child() -> None:
    """In the simulator's process before exec: SIGINT as usual again (the mask is
    inherited), and, on Linux, death with the gateway."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform == "linux":
        die_with_parent()


def _forward(pipe: IO[str], level: int, lines: list[str] | None = None) -> None:
    """Log each line of the child's `pipe` (and keep it in `lines`) from a daemon thread,
    until the child closes it: the child never blocks on a full pipe."""

    def read() -> None:
        for line in pipe:
            if lines is not None:
                lines.append(line)
            log.log(level, "simulator: %s", line.rstrip())

    threading.Thread(target=read, daemon=True).start()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False
