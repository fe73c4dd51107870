"""Benchmark scripts (`benchmarks/<name>/<script>.py`, not a package) loaded as modules, so
that a test runs the very scenario a benchmark measures instead of a copy of it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(relative: str) -> ModuleType:
    """The module of `benchmarks/<relative>` (e.g. "replicas/virtual.py"), loaded once."""
    name = "benchmark_" + relative.removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
