"""A private `redis-server` child process: for `kvgate serve --workers N`, tests and benchmarks.

It keeps nothing on disk (no RDB, no AOF) and listens either on a unix socket inside a
private directory (mode 0700: only this user can reach it, and no port can be taken from
under it) or on a TCP port of 127.0.0.1. It is started and waited for (a `PING` answered)
before `start` returns, and `stop` ends it (SIGTERM, then SIGKILL after a bound). On Linux
it also dies with the process that started it, so a killed supervisor leaves no server.
A supervisor that keeps it for others calls `revive` now and then: a server that died is
started again where it was, with a backoff.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvgate.procs.children import die_with_parent, stop
from kvgate.procs.ports import free_port

REDIS_SERVER = "redis-server"
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
# A dead server is started again this long after its death, twice as long each time it
# dies again within `_REVIVE_RESET_S` of a start, up to `_REVIVE_MAX_S`.
_REVIVE_FIRST_S = 0.5
_REVIVE_MAX_S = 30.0
_REVIVE_RESET_S = 60.0

log = logging.getLogger(__name__)


class RedisServerUnavailable(RuntimeError):
    """`redis-server` is not installed, or did not start."""


def find_redis_server() -> str | None:
    """The path of the `redis-server` executable, or None when it is not installed."""
    return shutil.which(REDIS_SERVER)


class RedisServer:
    """One `redis-server` process; `url` is what a `RedisStore` connects to."""

    def __init__(
        self, process: subprocess.Popen[bytes], workdir: Path, *, port: int | None, password: str
    ) -> None:
        self.process = process
        self.workdir = workdir
        self.port = port
        self.password = password
        self.command: list[str] = []  # how it was started (`revive` starts it so again)
        self._started_at = time.monotonic()
        self._dead_since: float | None = None
        self._backoff = _REVIVE_FIRST_S

    @property
    def socket_path(self) -> Path:
        return self.workdir / "redis.sock"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.port is None:
            return f"unix://{auth}{self.socket_path}?db=0"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @classmethod
    def start(
        cls,
        *,
        port: int | None = None,
        password: str = "",
        extra_args: tuple[str, ...] = (),
        timeout_s: float = _START_TIMEOUT_S,
    ) -> RedisServer:
        """Start a server on `port` of 127.0.0.1 (0: a free one), or on a unix socket when
        `port` is None."""
        executable = find_redis_server()
        if executable is None:
            raise RedisServerUnavailable(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        workdir = Path(tempfile.mkdtemp(prefix="kvgate-redis-"))  # mode 0700
        if port == 0:
            port = free_port()
        listen = (
            ["--port", "0", "--unixsocket", str(workdir / "redis.sock"), "--unixsocketperm", "700"]
            if port is None
            else ["--port", str(port), "--bind", "127.0.0.1"]
        )
        command = [
            executable, *listen,
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--daemonize", "no", "--logfile", "", "--loglevel", "warning",
            *(["--requirepass", password] if password else []),
            *extra_args,
        ]  # fmt: skip
        server = cls(_launch(command), workdir, port=port, password=password)
        server.command = command
        try:
            server._wait_ready(timeout_s)
        except BaseException:
            server.stop()
            raise
        return server

    def revive(self) -> None:
        """Called now and then by a supervisor: start the server again if it died, on the
        same socket or port with the same password (and empty: its clients find that out
        and beat back in), `_REVIVE_FIRST_S` after its death, doubling to `_REVIVE_MAX_S`
        while it dies again within `_REVIVE_RESET_S` of a start. It does not wait for
        the new server to answer. Each death and restart is logged."""
        now = time.monotonic()
        code = self.process.poll()
        if code is None:
            return
        if self._dead_since is None:
            self._dead_since = now
            log.warning(
                "the private redis-server (pid %d) exited with code %d: restarting it in %.1f s",
                self.process.pid,
                code,
                self._backoff,
            )
            return
        if now - self._dead_since < self._backoff:
            return
        ran = self._dead_since - self._started_at
        self._backoff = (
            _REVIVE_FIRST_S if ran >= _REVIVE_RESET_S else min(_REVIVE_MAX_S, self._backoff * 2)
        )
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = _launch(self.command)
        self._started_at, self._dead_since = now, None
        log.warning("restarted the private redis-server (pid %d)", self.process.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr
                err = stderr.read().decode(errors="replace") if stderr is not None else ""
                raise RedisServerUnavailable(
                    f"redis-server exited with code {self.process.returncode}: {err.strip()[:300]}"
                )
            if self.ping():
                return
            time.sleep(0.02)
        raise RedisServerUnavailable(f"redis-server did not answer within {timeout_s:.0f} s")

    def ping(self, timeout_s: float = 0.5) -> bool:
        """True when the server answers `PING` (authenticated when it has a password)."""
        try:
            with self._connect(timeout_s) as sock:
                if self.password:
                    sock.sendall(_command("AUTH", self.password))
                    if not sock.recv(64).startswith(b"+OK"):
                        return False
                sock.sendall(_command("PING"))
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _connect(self, timeout_s: float) -> socket.socket:
        if self.port is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(str(self.socket_path))
            except OSError:
                sock.close()
                raise
            return sock
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests): nothing is saved, the data is gone."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = _STOP_TIMEOUT_S) -> None:
        stop(self.process, timeout_s)
        if self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _launch(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C reaches the supervisor, which stops it
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
    )


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)
