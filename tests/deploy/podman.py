"""podman for the container tests: a small wrapper, the image built once per session, and
an SSE reader for the requests sent from the host.

Everything a test creates is named with the session's suffix and removed at its end, so
that two runs on one machine (or a developer's own images) never collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.tools import CONTAINER, unavailable

DEB_CACHE = Path.home() / ".cache" / "kvgate" / "debs"

#: What the tests measured (build times, image size), printed at the end of the session.
FIGURES: dict[str, str] = {}


@dataclass
class Podman:
    """`podman` with the environment the tests need (CONTAINERS_CONF)."""

    env: dict[str, str]
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def run(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            )
        return done

    def out(self, *args: str, timeout: float = 120.0) -> str:
        return self.run(*args, timeout=timeout).stdout.strip()

    def quietly(self, *args: str) -> None:
        """Clean-up: never fails the test (what it removes may already be gone)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.run(*args, check=False, timeout=120.0)

    def logs(self, name: str) -> str:
        done = self.run("logs", name, check=False)
        return done.stdout + done.stderr

    def pod_ip(self, pod: str, network: str) -> str:
        infra = self.out("pod", "inspect", pod, "--format", "{{.InfraContainerID}}")
        template = f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}'
        return self.out("inspect", infra, "--format", template)


def start_podman(tmp: Path) -> Podman:
    """A podman that can start containers here, or skip (fail in CI) saying why not."""
    if shutil.which("podman") is None:
        unavailable("podman is not installed (apt-get install podman runc mmdebstrap)")
    env = dict(os.environ)
    if "CONTAINERS_CONF" not in env:
        # The settings this kind of machine needs (see deploy/container/podman-conf.sh).
        if shutil.which("runc") is None:
            unavailable("runc is not installed (apt-get install runc)")
        conf = subprocess.run(
            ["bash", str(CONTAINER / "podman-conf.sh"), str(tmp / "containers.conf")],
            capture_output=True,
            text=True,
            check=True,
        )
        env["CONTAINERS_CONF"] = conf.stdout.strip()
    podman = Podman(env)
    probe = podman.run("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if probe.returncode != 0:
        unavailable(f"podman cannot run here: {probe.stderr.strip()}")
    return podman


@dataclass(frozen=True)
class Image:
    tag: str
    base: str
    version: str


def build_image(podman: Podman) -> Image:
    """deploy/container/build.sh --local-base: the base from Debian's packages, then the
    image on it, as CI and a user without a registry do. ~1.5-2 min on 2 cores; the
    .deb files are kept in ~/.cache/kvgate/debs (KVGATE_DEB_CACHE) for the next run."""
    if shutil.which("mmdebstrap") is None:
        unavailable("mmdebstrap is not installed (apt-get install mmdebstrap)")
    base = f"localhost/kvgate-test-base:{podman.suffix}"
    tag = f"localhost/kvgate-test:{podman.suffix}"
    started = time.monotonic()
    done = subprocess.run(
        [
            "bash",
            str(CONTAINER / "build.sh"),
            "--local-base",
            base,
            "--tag",
            tag,
            "--deb-cache",
            os.environ.get("KVGATE_DEB_CACHE", str(DEB_CACHE)),
        ],
        capture_output=True,
        text=True,
        env={**podman.env, "PYTHON": sys.executable},
        timeout=900,
        check=False,
    )
    total = time.monotonic() - started
    assert done.returncode == 0, f"build.sh failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip().splitlines()[-1] == tag
    steps = dict(re.findall(r"build\.sh: (base|wheelhouse|image)\b.*\(\+(\d+) s\)", done.stderr))
    FIGURES["image build (build.sh --local-base), total"] = f"{total:.0f} s"
    FIGURES["  Debian base (mmdebstrap + podman import)"] = f"{steps.get('base', '?')} s"
    if "base" in steps and "image" in steps:
        rest = int(steps["image"]) - int(steps["base"])
        FIGURES["  wheelhouse + podman build"] = f"{rest} s"
    size = int(podman.out("image", "inspect", tag, "--format", "{{.Size}}"))
    base_size = int(podman.out("image", "inspect", base, "--format", "{{.Size}}"))
    FIGURES["image size"] = f"{size / 1e6:.0f} MB (the Debian base: {base_size / 1e6:.0f} MB)"
    version = podman.out(
        "image", "inspect", tag, "--format", '{{index .Labels "org.opencontainers.image.version"}}'
    )
    return Image(tag=tag, base=base, version=version)


def wait_until(what: str, predicate: Any, within: float, every: float = 0.25) -> Any:
    """Poll `predicate()` until it returns something true; fail after `within` seconds."""
    deadline = time.monotonic() + within
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {within:.0f} s (last: {last!r})")


def ready(url: str, engines: int) -> dict[str, Any] | None:
    """kvgate's /readyz once it serves and sees `engines` fresh engines, else None."""
    response = httpx.get(f"{url}/readyz", timeout=3.0)
    if response.status_code != 200:
        return None
    body: dict[str, Any] = response.json()
    fresh = [node for node, ok in body["backends"].items() if ok]
    return body if len(fresh) == engines else None


@dataclass
class Stream:
    """A streamed chat completion as the client saw it."""

    status: int
    content: list[str]
    finish_reason: str | None
    done: bool


def chat_events(response: httpx.Response) -> Iterator[dict[str, Any] | None]:
    """The SSE events of a chat completion: each chunk, then None for `data: [DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        yield None if data == "[DONE]" else json.loads(data)


def read_stream(events: Iterator[dict[str, Any] | None], status: int) -> Stream:
    content: list[str] = []
    finish: str | None = None
    done = False
    for event in events:
        if event is None:
            done = True
            continue
        for choice in event.get("choices", []):
            text = choice.get("delta", {}).get("content")
            if text:
                content.append(text)
            finish = choice.get("finish_reason") or finish
    return Stream(status=status, content=content, finish_reason=finish, done=done)


def chat_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-llama",
        "messages": [{"role": "user", "content": "Say something about KV caches."}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def stream_chat(url: str, key: str | None, max_tokens: int = 16) -> Stream:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=chat_body(max_tokens), headers=headers,
        timeout=30.0,
    ) as response:  # fmt: skip
        if response.status_code != 200:
            response.read()
            return Stream(response.status_code, [], None, False)
        return read_stream(chat_events(response), response.status_code)
