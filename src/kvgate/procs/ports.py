"""Free ports on 127.0.0.1, for the servers kvgate, its tests and its benchmarks start."""

from __future__ import annotations

import socket

_TRIES = 200


def free_port(count: int = 1) -> int:
    """A port p such that p..p+count-1 were all free a moment ago (nothing listened there:
    also the way to get "connection refused")."""
    for _ in range(_TRIES):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if count == 1:
            return base
        if base + count <= 65536 and all(_is_free(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no block of {count} free ports found")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
