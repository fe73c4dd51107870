"""kvgate's container image, built by deploy/container/build.sh on a base made from
Debian's packages, run with podman: `kvgate serve` in the container, in front of two
simulated engines (`kvgate sim`, from the same image) in the same pod, serves streamed
chat completions requested from the host through a published port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from deploy.podman import (
    FIGURES,
    Image,
    Podman,
    chat_body,
    chat_events,
    read_stream,
    ready,
    stream_chat,
    wait_until,
)

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

KEY = "container-test-key-0123456789"
GATEWAY_PORTS = (8080, 8081, 8082)  # one per test's gateway, all published by the pod


@dataclass
class Pod:
    """A pod with two simulated engines on 127.0.0.1:8000-8001 and a key file."""

    name: str
    image: Image
    podman: Podman
    key_file: Path

    def gateway(self, port: int, *, keys: bool = True) -> tuple[str, str]:
        """Start `kvgate serve` (the image's entrypoint) on `port`; (container, host URL)."""
        name = f"{self.name}-gw{port}"
        auth = ["--volume", f"{self.key_file}:/etc/kvgate/api-keys.yaml:ro"]
        auth += ["--env", "KVGATE_AUTH__KEY_FILE=/etc/kvgate/api-keys.yaml"]
        self.podman.run(
            "run", "--detach", "--pod", self.name, "--name", name,
            *(auth if keys else []), self.image.tag,
            "--port", str(port),
            "--backend", "http://127.0.0.1:8000", "--backend", "http://127.0.0.1:8001",
        )  # fmt: skip
        published = self.podman.out("port", name, f"{port}/tcp")
        return name, f"http://{published.splitlines()[0]}"


@pytest.fixture(scope="module")
def pod(
    podman: Podman, kvgate_image: Image, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pod]:
    name = f"kvgate-test-{podman.suffix}"
    key_file = tmp_path_factory.mktemp("keys") / "api-keys.yaml"
    key_file.write_text(f"- key: {KEY}\n  tenant: team-a\n", encoding="utf-8")
    key_file.chmod(0o644)  # read by the image's non-root user
    publish = [arg for port in GATEWAY_PORTS for arg in ("--publish", f"127.0.0.1::{port}")]
    podman.run("pod", "create", "--name", name, *publish)
    try:
        # Slowed down 4x (~75 tokens/s) so that a stream lasts long enough to be drained.
        podman.run(
            "run", "--detach", "--pod", name, "--name", f"{name}-sim",
            "--entrypoint", "kvgate", kvgate_image.tag,
            "sim", "--nodes", "2", "--port", "8000", "--time-scale", "4",
        )  # fmt: skip
        yield Pod(name, kvgate_image, podman, key_file)
    finally:
        podman.quietly("pod", "rm", "--force", "--time", "0", name)


def test_kvgate_serve_in_the_image_streams_a_chat_completion_to_the_host(pod: Pod) -> None:
    started = time.monotonic()
    name, url = pod.gateway(8080)
    body = wait_until("kvgate ready with both engines", lambda: ready(url, 2), within=90)
    FIGURES["container: start to ready with 2 engines"] = f"{time.monotonic() - started:.1f} s"
    assert set(body["backends"]) == {"127.0.0.1:8000", "127.0.0.1:8001"}

    stream = stream_chat(url, KEY, max_tokens=16)
    assert stream.status == 200
    assert stream.done and stream.finish_reason == "length"
    assert len(stream.content) == 16, stream.content
    assert stream_chat(url, None).status == 401
    assert stream_chat(url, "not-a-key-of-this-gateway").status == 401
    metrics = httpx.get(f"{url}/metrics", timeout=5.0).text
    assert "kvgate_" in metrics

    logs = pod.podman.logs(name)
    assert "auth: 1 API key(s) configured on 0.0.0.0:8080" in logs
    assert pod.podman.out("exec", name, "id", "-u") == "10001"  # not root
    # The image's HEALTHCHECK (docker format), run once by hand: no systemd timers here.
    assert pod.podman.run("healthcheck", "run", name, check=False).returncode == 0


def test_without_api_keys_the_image_warns_that_it_is_open(pod: Pod) -> None:
    """0.0.0.0 in a container with no key is reachable by anyone who reaches the port:
    kvgate says so at start (the manifests configure keys for that reason)."""
    name, url = pod.gateway(8081, keys=False)
    wait_until("kvgate ready", lambda: ready(url, 2), within=90)
    logs = pod.podman.logs(name)
    assert "NO API KEYS configured and kvgate listens on 0.0.0.0:8081" in logs
    assert stream_chat(url, None, max_tokens=4).status == 200


def test_sigterm_lets_a_stream_in_flight_finish(pod: Pod) -> None:
    """What a rolling upgrade does to a replica (after preStop): SIGTERM. The stream in
    flight runs to its end, then kvgate exits 0."""
    name, url = pod.gateway(8082)
    wait_until("kvgate ready", lambda: ready(url, 2), within=90)
    max_tokens = 150  # ~2 s at the slowed engines' pace
    headers = {"authorization": f"Bearer {KEY}"}
    signalled = threading.Event()

    def terminate_after_first_tokens(events: Iterator[dict[str, object] | None]) -> Iterator:
        for seen, event in enumerate(events):
            if seen == 3:
                pod.podman.run("kill", "--signal", "TERM", name)
                signalled.set()
            yield event

    started = time.monotonic()
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=chat_body(max_tokens), headers=headers,
        timeout=30.0,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        stream = read_stream(terminate_after_first_tokens(chat_events(response)), 200)
    assert signalled.is_set()
    assert stream.done and stream.finish_reason == "length"
    assert len(stream.content) == max_tokens
    exit_code = pod.podman.out("wait", name, timeout=60)
    FIGURES["container: SIGTERM mid-stream to exit"] = f"{time.monotonic() - started:.1f} s"
    assert exit_code == "0"
    logs = pod.podman.logs(name)
    assert "shutting down: draining for up to 30.0 s" in logs
    assert "drain timeout" not in logs
