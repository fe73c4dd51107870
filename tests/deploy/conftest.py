"""Session fixtures of the container tests: podman, and kvgate's image built once.

The container tests (marked `container`) build kvgate's image and run it, about 3 minutes
on 2 cores, most of it building the image. They run only when asked for by marker,
`python -m pytest -q -m container` (a separate step of .ci/run), so that the suite's
command stays short; any other run deselects them and says so.

They need podman (with runc) and mmdebstrap. On a developer's machine without them they
skip, saying what is missing; under CI=true they fail, because .ci/run installs them.
They build the image from a base made of Debian's packages
(deploy/container/build.sh --local-base), since no container registry is reachable here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.podman import FIGURES, Image, Podman, build_image, start_podman


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    return start_podman(tmp_path_factory.mktemp("podman"))


@pytest.fixture(scope="session")
def kvgate_image(podman: Podman) -> Iterator[Image]:
    image = build_image(podman)
    try:
        yield image
    finally:
        podman.quietly("rmi", "--force", image.tag, image.base)


_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the container tests out unless the `-m` expression names them."""
    if "container" in (config.getoption("markexpr") or ""):
        return
    left_out = [item for item in items if item.get_closest_marker("container")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("container")]
        config.stash[_DESELECTED] = len(left_out)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """Print what the container tests measured, so every CI log carries the figures."""
    left_out = config.stash.get(_DESELECTED, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} container tests not run: `python -m pytest -q -m container` runs them"
        )
    if not FIGURES:
        return
    terminalreporter.section("container image: measured")
    for name, value in FIGURES.items():
        terminalreporter.write_line(f"{name}: {value}")
