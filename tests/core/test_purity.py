"""The core does no I/O and knows nothing of the shell: every import under `kvgate/core/`
is checked against a short list of modules that only compute.

The core is pure so that the same code runs live, in the simulator and in virtual time,
and so that it can be tested without sockets or clocks. An import is where that breaks
first (asyncio, a socket, a file, the environment, the gateway), so each one, lazy imports
inside functions included, must be on the list below or in `kvgate.core` itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from importlib.util import resolve_name
from pathlib import Path

import kvgate.core

CORE = Path(kvgate.core.__file__).parent

#: Standard-library modules that compute and never touch a file, socket, process or clock.
PURE_STDLIB = frozenset(
    {
        "__future__",
        "abc",
        "bisect",
        "collections",
        "collections.abc",
        "copy",
        "dataclasses",
        "enum",
        "fractions",
        "functools",
        "heapq",
        "itertools",
        "math",
        "numbers",
        "operator",
        # `random.Random(rng_seed)`: reproducible when seeded; unseeded, it draws OS
        # entropy once when a policy is built, never per request.
        "random",
        "statistics",
        "types",
        "typing",
    }
)
#: Validation of the settings models; pydantic itself reads no file or environment.
THIRD_PARTY = frozenset({"pydantic"})
#: The one place the core may read the real time: the live clock it is injected with (by
#: path under `kvgate/core/`: a `clock.py` in a subpackage is not that place).
PER_FILE = {"clock.py": frozenset({"time"})}


def imports(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute name) of everything `source` imports, at any depth; a name taken
    from a module is reported under it (`from os import path` is `os.path`)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def allowed(name: str, filename: str) -> bool:
    """Whether `name` is, or lies inside, a module the core may import from the module at
    `filename` (its path under `kvgate/core/`)."""
    permitted = {"kvgate.core", *PURE_STDLIB, *THIRD_PARTY, *PER_FILE.get(filename, ())}
    parts = name.split(".")
    return any(".".join(parts[:i]) in permitted for i in range(1, len(parts) + 1))


def violations(path: Path) -> list[str]:
    rel = path.relative_to(CORE.parent.parent)
    package = ".".join(path.relative_to(CORE.parent.parent).parent.parts)
    return [
        f"{rel}:{line} imports {name}"
        for line, name in imports(path.read_text(), package)
        if not allowed(name, path.relative_to(CORE).as_posix())
    ]


def test_the_core_imports_only_pure_modules() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10, files  # the walk found the core
    found = [v for path in files for v in violations(path)]
    assert not found, "the core must do no I/O and not import the shell:\n" + "\n".join(found)


def test_the_check_catches_io_and_shell_imports() -> None:
    source = """
import asyncio
import os.path
from socket import socket
from kvgate.gateway.app import Gateway
from kvgate import adapters
from .. import sim
def later():
    import aiohttp
    from time import monotonic
"""
    flagged = [m for _, m in imports(source, "kvgate.core") if not allowed(m, "policy.py")]
    assert flagged == [
        "asyncio",
        "os.path",
        "socket.socket",
        "kvgate.gateway.app.Gateway",
        "kvgate.adapters",
        "kvgate.sim",
        "aiohttp",
        "time.monotonic",
    ]
    assert allowed("time.monotonic", "clock.py")
    assert not allowed("time.monotonic", "plan/clock.py")
    assert allowed("kvgate.core.clock.Clock", "policy.py")
    assert not allowed("kvgate.corex", "policy.py")
    assert not allowed("pydantic_settings", "settings.py")
