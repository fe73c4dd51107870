"""Child processes kvgate starts (the built-in simulator, a private redis-server, the
workers of `--workers`): they die with the process that started them, and are stopped
politely, then firmly."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from typing import Any


def die_with_parent() -> None:
    """In the child before exec (`preexec_fn`, Linux): ask the kernel to SIGTERM it when
    its parent dies, so a killed kvgate leaves no child behind."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop(process: subprocess.Popen[Any], timeout_s: float) -> None:
    """SIGTERM, up to `timeout_s` to exit, then SIGKILL; returns once it has exited."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
