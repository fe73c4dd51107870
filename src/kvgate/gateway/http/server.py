"""Serve the gateway with uvicorn (HTTP/1.1) or hypercorn (HTTP/2, h2c and TLS+ALPN).

Why two servers: uvicorn with uvloop and httptools is the cheapest HTTP/1.1 server in
Python: hypercorn costs 2.3x its CPU per request for the same app and upstream client
(`benchmarks/proxy_overhead/results.md`), so uvicorn is the default. But uvicorn does not
speak HTTP/2, which kvgate's clients may (prior-knowledge h2c on a plain port, h2
negotiated by ALPN with TLS: HTTP/2 clients and proxies that multiplex many streams on one
connection); hypercorn does, and maps an `RST_STREAM` to `http.disconnect` of that one
stream, so cancelling one stream cancels only its request. It is used only when asked
(`server.server: hypercorn`).

Logging: neither server installs log handlers of its own; their lines go through Python
logging in the format kvgate's logging was given (kvgate.gateway.ops.logs).

`/metrics` can be served on an address of its own (`server.metrics_listen`): a second,
plain-HTTP uvicorn server on that socket runs `Gateway.serve_metrics`, and the main
address then has no `/metrics`.

Graceful shutdown is the same for both: the first SIGTERM/SIGINT closes the listening
socket, new requests on kept-alive connections get 503, in-flight requests may finish for
`drain_timeout_s`, then whatever is left is cancelled (upstream too) and the lifespan
stops the scraper and closes the upstream pool. A second SIGINT (not SIGTERM: supervisors
repeat those) exits at once. SIGHUP re-reads the configuration and applies its list of
backends without a restart (see kvgate.gateway.engines.backend_set).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable, Generator

import uvicorn

from kvgate.gateway.app import Gateway
from kvgate.gateway.http.guard import (
    ConnectionLimits,
    GuardCollector,
    GuardedHttpToolsProtocol,
    hypercorn_limits,
)
from kvgate.gateway.security.auth import exposure_message
from kvgate.gateway.settings import ServerSettings, listen_address

log = logging.getLogger(__name__)

#: Extra time the ASGI server waits after the drain before it cancels tasks itself.
_SERVER_GRACE_S = 3.0


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket (port 0 picks a free one; read it from `getsockname()`).

    `reuse_port`: SO_REUSEPORT, so that several worker processes listen on one port and
    the kernel spreads the connections over them (`kvgate serve --workers N`).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _settle_heap() -> None:
    """Move everything alive at start (modules, config, metric families) out of the
    collector's sight before serving.

    They live as long as the process, yet every full collection would walk them all again
    (a full collection of a gateway's heap took 34-72 ms, measured with gc callbacks over
    a gateway's life, start and exit included). Frozen, a collection walks only what the
    traffic allocated. Called before serving and again once uvicorn has started: its
    start-up (lifespan, scraper, uvicorn's own lazy imports) left ~50k objects that made
    each full collection under traffic pause the loop for 37-42 ms.
    """
    gc.collect()
    gc.freeze()


class GatewayServer:
    """Runs one `Gateway` on one socket until `stop()` (or a signal) and the drain end."""

    def __init__(
        self,
        gateway: Gateway,
        settings: ServerSettings | None = None,
        *,
        settle_heap: bool = False,
        connection_limits: ConnectionLimits | None = None,
    ) -> None:
        self.gateway = gateway
        self.settings = settings or gateway.config.server
        self.connection_limits = connection_limits or ConnectionLimits()
        # Freeze the heap before serving and once uvicorn has started (`_settle_heap`); only
        # when the process is this gateway's: freezing a test's or an embedder's heap would
        # keep its garbage for good.
        self.settle_heap = settle_heap
        self._stop = asyncio.Event()
        self._uvicorn: _Uvicorn | None = None
        self._metrics: _Uvicorn | None = None
        self._drain_task: asyncio.Task[None] | None = None

    @property
    def tls(self) -> bool:
        return bool(self.settings.certfile and self.settings.keyfile)

    def stop(self, *, force_if_repeated: bool = False) -> None:
        """Begin the graceful shutdown; a repeated call forces it if `force_if_repeated`."""
        if self._stop.is_set():
            if not force_if_repeated:
                return
            log.warning("second interrupt: exiting now")
            if self._uvicorn is not None:
                self._uvicorn.force_exit = True
            self.gateway.relay.cancel_all("shutdown")
            return
        self._stop.set()
        log.info("shutting down: draining for up to %.1f s", self.settings.drain_timeout_s)
        # The server closes its listener and idle connections now and waits for the busy
        # ones; the drain, alongside, cancels whatever outlives `drain_timeout_s`.
        self._drain_task = asyncio.get_running_loop().create_task(
            self.gateway.drain(self.settings.drain_timeout_s)
        )
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def reload(self) -> None:
        """SIGHUP: re-read the configuration and apply its backends (the gateway logs what
        changed); a configuration that cannot be applied changes nothing."""
        with contextlib.suppress(Exception):  # logged by the gateway; nothing was changed
            self.gateway.reload()

    async def serve(
        self,
        sock: socket.socket,
        *,
        handle_signals: bool = True,
        metrics_sock: socket.socket | None = None,
    ) -> None:
        """Serve on `sock` until stopped; returns after the drain and the lifespan shutdown.

        With `server.metrics_listen`, `/metrics` is served on `metrics_sock` (bound here
        when not given) until the main server has stopped."""
        if self.settings.metrics_listen and metrics_sock is None:
            metrics_sock = bind_socket(*listen_address(self.settings.metrics_listen))
        if self.settle_heap:
            _settle_heap()  # what lives now lives to the end (uvicorn settles again, started)
        self._log_exposure(sock)
        metrics_task = None
        if metrics_sock is not None:
            metrics_task = asyncio.get_running_loop().create_task(self._serve_metrics(metrics_sock))
        try:
            with self._signals(handle_signals):
                if self.settings.server == "hypercorn":
                    await self._serve_hypercorn(sock)
                else:
                    await self._serve_uvicorn(sock)
            if self._drain_task is not None:
                await self._drain_task
        finally:
            if metrics_task is not None:
                if self._metrics is not None:
                    self._metrics.should_exit = True
                else:
                    metrics_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await metrics_task

    async def _serve_metrics(self, sock: socket.socket) -> None:
        """`/metrics` alone, over plain HTTP/1.1, for Prometheus."""
        config = uvicorn.Config(
            self.gateway.serve_metrics,
            interface="asgi3",  # a bound method: uvicorn would guess ASGI 2
            loop="none",
            lifespan="off",
            ws="none",
            log_config=None,
            log_level=self.settings.log_level.lower(),
            access_log=False,
            server_header=False,
            proxy_headers=False,
        )
        self._metrics = _Uvicorn(config, on_started=None)
        if self._stop.is_set():
            self._metrics.should_exit = True
        await self._metrics.serve(sockets=[sock])

    async def _serve_uvicorn(self, sock: socket.socket) -> None:
        s = self.settings
        protocol = GuardedHttpToolsProtocol.with_limits(self.connection_limits)
        self.gateway.metrics.registry.register(GuardCollector(protocol))
        config = uvicorn.Config(
            self.gateway,
            # httptools plus header-size, slow-client and connection limits (guard.py)
            http=protocol,
            loop="none",
            lifespan="on",
            ws="none",  # kvgate serves no WebSocket: no upgrade checks, no websockets import
            log_config=None,  # its lines go through kvgate's logging (one format)
            log_level=s.log_level.lower(),
            access_log=False,
            server_header=False,
            proxy_headers=False,  # no X-Forwarded-* rewriting: one middleware less per request
            timeout_keep_alive=30,
            timeout_graceful_shutdown=int(s.drain_timeout_s + _SERVER_GRACE_S),
            ssl_certfile=s.certfile if self.tls else None,
            ssl_keyfile=s.keyfile if self.tls else None,
            backlog=2048,
        )
        self._uvicorn = _Uvicorn(config, on_started=_settle_heap if self.settle_heap else None)
        if self._stop.is_set():
            self._uvicorn.should_exit = True
        await self._uvicorn.serve(sockets=[sock])

    async def _serve_hypercorn(self, sock: socket.socket) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        s = self.settings
        config = Config()
        config.bind = [f"fd://{sock.fileno()}"]
        if self.tls:
            config.certfile = s.certfile
            config.keyfile = s.keyfile
            config.alpn_protocols = ["h2", "http/1.1"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.loglevel = s.log_level.upper()
        config.graceful_timeout = s.drain_timeout_s + _SERVER_GRACE_S
        config.keep_alive_timeout = 30
        config.h2_max_concurrent_streams = 1000
        config.include_server_header = False
        hypercorn_limits(config)

        async def shutdown_trigger() -> None:
            await self._stop.wait()
            # Hypercorn closes the listener now and then waits `graceful_timeout` for
            # requests; the drain runs alongside and cancels what is left in time.

        await serve(self.gateway, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]

    def _log_exposure(self, sock: socket.socket) -> None:
        """Say at start who can reach this gateway (a warning: public and no API keys)."""
        host, port = sock.getsockname()[:2]
        security = self.gateway.security
        keys, admin = len(security.front.keys), security.admin.has_token
        level, text = exposure_message(host, port, keys, admin)
        log.log(level, "%s", text)

    @contextlib.contextmanager
    def _signals(self, enabled: bool) -> Generator[None, None, None]:
        if not enabled:
            yield
            return
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        handlers = {
            signal.SIGTERM: self.stop,
            signal.SIGINT: lambda: self.stop(force_if_repeated=True),  # Ctrl-C twice: now
            signal.SIGHUP: self.reload,
        }
        for sig, handler in handlers.items():
            try:
                loop.add_signal_handler(sig, handler)
            except (NotImplementedError, RuntimeError, ValueError) as exc:
                log.warning("cannot handle %s (%s): it will stop kvgate at once", sig.name, exc)
            else:
                installed.append(sig)
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (`GatewayServer` owns the signals), calling
    `on_started` once it has started: the lifespan has run and the socket is served."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self._on_started is not None and not self.should_exit:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def run_server(
    gateway: Gateway,
    sock: socket.socket,
    on_ready: Callable[[], None] | None = None,
    metrics_sock: socket.socket | None = None,
) -> None:
    """Blocking entry point: an event loop (uvloop when installed) serving until SIGTERM."""
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass

    async def main() -> None:
        server = GatewayServer(gateway, settle_heap=True)  # the process is this gateway's
        if on_ready is not None:
            on_ready()
        await server.serve(sock, metrics_sock=metrics_sock)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
