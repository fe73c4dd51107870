"""Free ports on 127.0.0.1 for servers that tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on right now (also the way to get "connection refused")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
