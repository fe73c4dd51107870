"""The code's own checks, run with the suite so that CI enforces them.

`ruff` (lint and format) and `mypy` (with the pydantic plugin, configured in
pyproject.toml) over the package. Their versions are pinned in the `test` extra, so a new
release cannot fail a build that changed nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def _ruff() -> str:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed (it is in the `test` extra)")
    return found


def test_ruff_lint_is_clean() -> None:
    result = _run(_ruff(), "check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _run(_ruff(), "format", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_mypy_is_clean() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr
