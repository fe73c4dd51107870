"""What the deployment tests share: where things are, rendering the manifests, and the
rule for missing tools (skip on a developer's machine, fail in CI, which installs them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINER = ROOT / "deploy" / "container"
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("simulated-engines", "production")
NAMESPACE = "kvgate"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> NoReturn:
    """Skip on a developer's machine; fail in CI, whose .ci/run installs what is needed."""
    if in_ci():
        pytest.fail(f"required in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        unavailable("kubectl (with its built-in kustomize) is not installed")
    return found


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`, parsed: every object it renders, in order."""
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def production_copy(into: Path) -> Path:
    """deploy/kubernetes copied into `into`, with the files that overlays/production reads
    and nobody commits (its secrets/) written as a user would; returns the copy's root."""
    tree = into / "kubernetes"
    shutil.copytree(KUBERNETES, tree)
    secrets = tree / "overlays" / "production" / "secrets"
    (secrets / "api-keys.yaml").write_text(
        "keys:\n  - key_sha256: " + "ab" * 32 + "\n    tenant: prod\n", encoding="utf-8"
    )
    (secrets / "admin-token").write_text("a-long-random-admin-token", encoding="utf-8")
    return tree


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of `kind` whose name is `name` or, for generated ones, `name-<hash>`."""
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (d["metadata"]["name"] == name or d["metadata"]["name"].rsplit("-", 1)[0] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def containers(deployment: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from deployment["spec"]["template"]["spec"]["containers"]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [c for c in containers(deployment) if c["name"] == name]
    assert len(matches) == 1, f"no container {name} in {deployment['metadata']['name']}"
    return matches[0]
