"""`podman kube play` runs the rendered Deployments of overlays/simulated-engines: three
kvgate replicas in front of two simulated engines, found through `discover: dns` under the
headless Service's name, and a request through each replica succeeds.

podman is not a cluster, and Debian's podman 4.3 plays only part of what Kubernetes
does. What the test changes in the rendered objects, and why (nothing else is changed):

- the image is the one this session built;
- `containerPort`s are dropped (probes name the port by number instead): podman before
  4.5 publishes every containerPort on every address of the host, so the replicas would
  collide on port 8080 and the gateway would be exposed beyond the test;
- the Secret is played as a ConfigMap of the same name and content, mounted and referenced
  the same way: podman 4.3 writes a Secret's data into the volume still base64-encoded and
  cannot set an environment variable from it (containers/podman#16269);
- there is no cluster DNS, so no Service exists: the headless Service's name
  (`vllm-engines.kvgate.svc`) is given the engine pods' addresses in each kvgate pod's
  /etc/hosts (`hostAliases`), one line per address, as its DNS A records would be.

What podman does not do at all, and this test therefore cannot check: Services (the
kvgate ClusterIP, the headless Service's DNS records following pods that come and go),
readiness gating of traffic (there is no Service whose endpoints it would gate),
liveness restarts (podman 4.3 turns the liveness probe into a `curl` healthcheck, which
this image could not run, driven by systemd timers, which this machine does not have),
the preStop hook and terminationGracePeriodSeconds (podman stops with its own 10 s), the
PodDisruptionBudget, anti-affinity and topology spread, resource requests, the
Namespace, ServiceAccount, NetworkPolicy and ServiceMonitor. The schemas and how those
pieces fit are checked offline in test_manifests.py; SIGTERM draining in test_image.py.
"""

from __future__ import annotations

import base64
import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deploy.podman import FIGURES, Image, Podman, ready, stream_chat, wait_until
from deploy.tools import KUBERNETES, container, containers, find, render

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

ENGINES_HOST = "vllm-engines.kvgate.svc"


def for_podman(doc: dict[str, Any], image: Image, suffix: str) -> dict[str, Any]:
    """One rendered Deployment as podman 4.3 can play it (see the module docstring)."""
    doc = copy.deepcopy(doc)
    doc["metadata"]["name"] = f"{doc['metadata']['name']}-{suffix}"  # pods never collide
    for c in containers(doc):
        c["image"] = image.tag
        named = {p["name"]: p["containerPort"] for p in c.pop("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet")
            if get and get["port"] in named:
                get["port"] = named[get["port"]]
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).pop("secretKeyRef", None)
            if ref is not None:
                env["valueFrom"]["configMapKeyRef"] = ref
    for volume in doc["spec"]["template"]["spec"].get("volumes", []):
        secret = volume.pop("secret", None)
        if secret is not None:
            volume["configMap"] = {
                "name": secret["secretName"],
                **{k: v for k, v in secret.items() if k != "secretName"},
            }
    return doc


def secret_as_config_map(secret: dict[str, Any]) -> dict[str, Any]:
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": secret["metadata"], "data": data}


@dataclass
class Played:
    podman: Podman
    rendered: list[dict[str, Any]]
    network: str
    gateway_pods: list[str]
    gateway_containers: list[str]
    engine_ips: list[str]

    def url(self, pod: str) -> str:
        return f"http://{self.podman.pod_ip(pod, self.network)}:8080"


def pods_of(deployment: dict[str, Any]) -> list[str]:
    """The pods podman makes of a Deployment: one per replica, `<name>-pod-<i>`."""
    name = deployment["metadata"]["name"]
    return [f"{name}-pod-{i}" for i in range(deployment["spec"]["replicas"])]


def write_yaml(path: Path, docs: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def played(
    podman: Podman, kvgate_image: Image, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Played]:
    rendered = render(KUBERNETES / "overlays" / "simulated-engines")
    tmp = tmp_path_factory.mktemp("kube-play")
    suffix = podman.suffix
    engines = for_podman(find(rendered, "Deployment", "vllm-sim"), kvgate_image, suffix)
    gateway = for_podman(find(rendered, "Deployment", "kvgate"), kvgate_image, suffix)
    config_maps = [d for d in rendered if d["kind"] == "ConfigMap"]
    config_maps.append(secret_as_config_map(find(rendered, "Secret", "kvgate-secrets")))
    engines_file = write_yaml(tmp / "engines.yaml", [engines])
    gateway_file = tmp / "kvgate.yaml"
    network = f"kvgate-test-{suffix}"
    podman.run("network", "create", network)
    try:
        started = time.monotonic()
        podman.run("kube", "play", "--network", network, str(engines_file), timeout=300)
        ips = [podman.pod_ip(pod, network) for pod in pods_of(engines)]
        gateway["spec"]["template"]["spec"]["hostAliases"] = [
            {"ip": ip, "hostnames": [ENGINES_HOST]} for ip in ips
        ]
        write_yaml(gateway_file, [*config_maps, gateway])
        podman.run("kube", "play", "--network", network, str(gateway_file), timeout=300)
        FIGURES["kube play: both Deployments created"] = f"{time.monotonic() - started:.1f} s"
        pods = pods_of(gateway)
        yield Played(
            podman=podman,
            rendered=rendered,
            network=network,
            gateway_pods=pods,
            gateway_containers=[f"{pod}-kvgate" for pod in pods],
            engine_ips=ips,
        )
    finally:
        for played_file in (gateway_file, engines_file):
            if played_file.exists():
                podman.quietly("kube", "down", str(played_file))
        podman.quietly("network", "rm", "--force", network)


def test_podman_made_one_pod_per_replica(played: Played) -> None:
    listed = played.podman.out("pod", "ps", "--format", "{{.Name}} {{.Status}}").splitlines()
    status = dict(line.split(maxsplit=1) for line in listed)
    gateway = find(played.rendered, "Deployment", "kvgate")
    engines = find(played.rendered, "Deployment", "vllm-sim")
    assert len(played.gateway_pods) == gateway["spec"]["replicas"] == 3
    assert len(played.engine_ips) == engines["spec"]["replicas"] == 2
    for pod in played.gateway_pods:
        assert status.get(pod) == "Running", listed


def test_every_replica_discovers_the_engines_and_streams_a_completion(played: Played) -> None:
    secret = find(played.rendered, "Secret", "kvgate-secrets")
    keys = yaml.safe_load(base64.b64decode(secret["data"]["api-keys.yaml"]))["keys"]
    key = keys[0]["key"]
    expected = {f"vllm@{ip}:8000" for ip in played.engine_ips}
    started = time.monotonic()
    for pod in played.gateway_pods:
        url = played.url(pod)
        body = wait_until(f"{pod} ready with both engines", lambda u=url: ready(u, 2), 120)
        # discover: dns expanded the rendered URL's host into one backend per address.
        assert set(body["backends"]) == expected
        stream = stream_chat(url, key, max_tokens=8)
        assert stream.status == 200 and stream.done, pod
        assert len(stream.content) == 8
        assert stream_chat(url, None).status == 401
    FIGURES["kube play: all replicas ready and served"] = f"{time.monotonic() - started:.1f} s"


def test_the_pods_run_as_rendered(played: Played) -> None:
    """Config and key file mounted where kvgate.yaml says, the admin token set from the
    secret, the Prometheus annotation's port and path served, a non-root user on a
    read-only root file system."""
    pod, name = played.gateway_pods[0], played.gateway_containers[0]
    url = played.url(pod)
    wait_until(f"{pod} ready", lambda: ready(url, 2), within=120)
    logs = played.podman.logs(name)
    assert "auth: 2 API key(s) configured on 0.0.0.0:8080" in logs
    assert "admin routes need server.admin_token" in logs

    secret = find(played.rendered, "Secret", "kvgate-secrets")
    token = base64.b64decode(secret["data"]["admin-token"]).decode()
    auth = {"authorization": f"Bearer {token}"}
    assert httpx.get(f"{url}/admin/state", headers=auth, timeout=5.0).status_code == 200
    wrong = {"authorization": "Bearer not-the-admin-token"}
    assert httpx.get(f"{url}/admin/state", headers=wrong, timeout=5.0).status_code == 401

    template = find(played.rendered, "Deployment", "kvgate")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    port, path = annotations["prometheus.io/port"], annotations["prometheus.io/path"]
    ip = played.podman.pod_ip(pod, played.network)
    metrics = httpx.get(f"http://{ip}:{port}{path}", timeout=5.0)
    assert metrics.status_code == 200 and "kvgate_" in metrics.text

    # The docs' way to watch a replica: its own CLI, with the token from the environment.
    status = played.podman.run("exec", name, "kvgate", "status", check=False)
    assert status.returncode == 0, status.stderr
    assert all(f"{ip}:8000" in status.stdout for ip in played.engine_ips), status.stdout

    security = template["spec"]["securityContext"]
    assert played.podman.out("exec", name, "id", "-u") == str(security["runAsUser"])
    assert container(find(played.rendered, "Deployment", "kvgate"), "kvgate")["securityContext"][
        "readOnlyRootFilesystem"
    ]
    write = played.podman.run("exec", name, "touch", "/etc/kvgate/x", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    # /tmp is the emptyDir: writable.
    assert played.podman.run("exec", name, "touch", "/tmp/x", check=False).returncode == 0
