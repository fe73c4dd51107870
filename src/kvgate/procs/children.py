"""Child processes kvgate starts (the built-in simulator, a private redis-server, the
workers of `--workers`): they die with the process that started them, and are stopped
politely, then firmly."""

from __future__ import annotations

import asyncio
import contextlib
import os
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


def stop(process: subprocess.Popen[Any], timeout_s: float, *, group: bool = False) -> None:
    """SIGTERM, up to `timeout_s` to exit, then SIGKILL; returns once it has exited.
    `group`: signal its whole process group (a child started with `start_new_session`
    whose own children must go with it, such as a shell script that runs a server)."""
    if process.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)

    send(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        process.wait()


async def stop_async(process: asyncio.subprocess.Process, timeout_s: float = 20.0) -> None:
    """`stop` for a child started with asyncio: SIGTERM, up to `timeout_s`, then SIGKILL."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
