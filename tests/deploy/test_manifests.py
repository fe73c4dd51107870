"""deploy/kubernetes: every rendered object is valid Kubernetes, and the pieces fit together.

Each kustomization (the base and every overlay) is rendered by `kubectl kustomize` and
every object is validated offline, in strict mode (no unknown field), against the schemas
of the oldest Kubernetes release the manifests support (1.29) and of the newest one the
`kubernetes-validate` package ships (fields are added and removed at those two ends).
The ServiceMonitor is a custom resource of the Prometheus Operator, whose schema that
package does not have: it is checked by hand against the Service it scrapes.

The rest checks what a schema cannot: that the probes, ports, secrets, config paths,
labels and shutdown timings agree with each other and with kvgate itself (the ConfigMap's
kvgate.yaml is loaded by kvgate's own loader).
"""

from __future__ import annotations

import base64
import importlib.metadata
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from deploy.tools import (
    KUBERNETES,
    NAMESPACE,
    OVERLAYS,
    container,
    containers,
    find,
    production_copy,
    render,
)
from kvgate.config import KvgateConfig
from kvgate.gateway.settings import listen_address

OLDEST_KUBERNETES = (1, 29)
# kvgate's HTTP server keeps waiting up to 3 s after the drain (kvgate.gateway.http.server);
# the grace period must cover that and the process exit, with room to spare.
SHUTDOWN_MARGIN_S = 5.0
CUSTOM_RESOURCES = {"monitoring.coreos.com/v1": {"ServiceMonitor"}}
KUSTOMIZATIONS = ("base", *OVERLAYS)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every kustomization, rendered: the production overlay from a copy that has the
    secret files it expects a user to write."""
    copy = production_copy(tmp_path_factory.mktemp("kubernetes"))
    out = {"base": render(KUBERNETES / "base")}
    for overlay in OVERLAYS:
        source = copy if overlay == "production" else KUBERNETES
        out[overlay] = render(source / "overlays" / overlay)
    return out


def kubernetes_versions() -> list[str]:
    """The oldest supported release and the newest one with schemas."""
    shipped = sorted({tuple(int(p) for p in v.split(".")[:2]) for v in all_versions()})
    assert OLDEST_KUBERNETES in shipped, f"no schemas for Kubernetes {OLDEST_KUBERNETES}"
    return [f"{major}.{minor}.0" for major, minor in (OLDEST_KUBERNETES, shipped[-1])]


def kvgate_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", "kvgate")


def kvgate_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = find(docs, "ConfigMap", "kvgate-config")
    loaded: dict[str, Any] = yaml.safe_load(config_map["data"]["kvgate.yaml"])
    return loaded


def secret_data(docs: list[dict[str, Any]]) -> dict[str, str]:
    secret = find(docs, "Secret", "kvgate-secrets")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_is_valid_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    versions = kubernetes_versions()
    validated: set[str] = set()
    for doc in rendered[name]:
        if doc["kind"] in CUSTOM_RESOURCES.get(doc["apiVersion"], set()):
            continue  # no schema shipped: see test_service_monitor_scrapes_the_kvgate_service
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = f"{doc['kind']}/{doc['metadata']['name']} for Kubernetes {version}"
                pytest.fail(f"{name}: {where}: {exc.message} at {list(exc.path)}")
        validated.add(doc["kind"])
    expected = {"Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment"}
    expected.add("PodDisruptionBudget")
    assert expected <= validated, f"{name}: not rendered: {expected - validated}"


def test_strict_validation_catches_a_misspelt_or_mistyped_field(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The check above would pass vacuously if the validator accepted anything."""
    version = kubernetes_versions()[-1]
    good = kvgate_deployment(rendered["base"])
    kubernetes_validate.validate(good, version, strict=True)
    misspelt = yaml.safe_load(yaml.safe_dump(good))
    container(misspelt, "kvgate")["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    mistyped = yaml.safe_load(yaml.safe_dump(good))
    mistyped["spec"]["replicas"] = "three"
    for broken in (misspelt, mistyped):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, version, strict=True)


def test_service_monitor_scrapes_the_kvgate_service(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["production"]
    monitor = find(docs, "ServiceMonitor", "kvgate")
    service = find(docs, "Service", "kvgate")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"] == NAMESPACE
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    assert not any(d["kind"] == "ServiceMonitor" for d in rendered["base"])


# ---------------------------------------------------------------- how the pieces fit


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_three_replicas_spread_and_protected(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = rendered[name]
    deployment = kvgate_deployment(docs)
    spec = deployment["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 3
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    budget = find(docs, "PodDisruptionBudget", "kvgate")
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["spec"]["maxUnavailable"] == 1
    terms = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        and t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod_labels.items()
        for t in terms
    )
    for deploy in (d for d in docs if d["kind"] == "Deployment"):
        for c in containers(deploy):
            requests = c["resources"]["requests"]
            assert {"cpu", "memory"} <= requests.keys(), f"{deploy['metadata']['name']}/{c['name']}"
            assert "memory" in c["resources"]["limits"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_ports_and_scrape_annotations_name_kvgates_routes(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = rendered[name]
    deployment = kvgate_deployment(docs)
    gateway = container(deployment, "kvgate")
    port = listen_address(kvgate_config(docs)["server"]["listen"])[1]
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": port}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    service = find(docs, "Service", "kvgate")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_shutdown_outlasts_the_drain(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    """preStop sleeps while the endpoints controller and kube-proxies drop the pod, then
    SIGTERM starts kvgate's drain: the grace period, which counts from the start of
    preStop, must cover the sleep, the whole drain and the server's own shutdown."""
    docs = rendered[name]
    deployment = kvgate_deployment(docs)
    command = container(deployment, "kvgate")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", shlex.join(command)
    pre_stop_s = float(command[1])
    assert pre_stop_s >= 5, "endpoint removal takes seconds to reach every node"
    drain_s = float(kvgate_config(docs)["server"]["drain_timeout_s"])
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= pre_stop_s + drain_s + SHUTDOWN_MARGIN_S, (grace_s, pre_stop_s, drain_s)


@pytest.mark.parametrize("name", OVERLAYS)
def test_config_map_loads_with_kvgates_own_loader(
    rendered: dict[str, list[dict[str, Any]]], name: str, tmp_path: Path
) -> None:
    """The ConfigMap's kvgate.yaml, with the Secret's key file where the pod mounts it,
    is a valid kvgate configuration that listens on the pod's address with keys."""
    docs = rendered[name]
    deployment = kvgate_deployment(docs)
    gateway = container(deployment, "kvgate")
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert gateway["args"] == ["--config", f"{mounts[config_volume]}/kvgate.yaml"]

    data = kvgate_config(docs)
    secret_volume = next(v for v in volumes.values() if "secret" in v)["secret"]
    key_file_item = next(i for i in secret_volume["items"] if i["key"] == "api-keys.yaml")
    secret_mount = mounts[next(n for n, v in volumes.items() if "secret" in v)]
    assert data["auth"]["key_file"] == f"{secret_mount}/{key_file_item['path']}"
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(secret_data(docs)["api-keys.yaml"], encoding="utf-8")
    data["auth"]["key_file"] = str(keys)
    config = KvgateConfig(**data)

    assert config.server.address[0] == "0.0.0.0"
    assert config.auth.all_keys(), "a pod listening on its address must require API keys"
    assert "store" not in data  # set by KVGATE_STORE__URL where Redis is deployed
    [backend] = config.backends
    assert backend.discover == "dns"
    engines = find(docs, "Service", "vllm-engines")
    assert engines["spec"]["clusterIP"] == "None"  # headless: DNS gives the pods' addresses
    host, _, port = backend.url.removeprefix("http://").partition(":")
    assert host == f"vllm-engines.{engines['metadata']['namespace']}.svc"
    assert int(port) in {p["port"] for p in engines["spec"]["ports"]}
    assert config.server.drain_timeout_s > 0


@pytest.mark.parametrize("name", OVERLAYS)
def test_secret_feeds_the_key_file_and_the_admin_token(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = rendered[name]
    data = secret_data(docs)
    secret_name = find(docs, "Secret", "kvgate-secrets")["metadata"]["name"]
    gateway = container(kvgate_deployment(docs), "kvgate")
    [admin] = [e for e in gateway["env"] if e["name"] == "KVGATE_SERVER__ADMIN_TOKEN"]
    ref = admin["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret_name
    token = data[ref["key"]]
    # A trailing newline (what `echo` writes) would become part of the token.
    assert token == token.strip() and len(token) >= 16
    volume = next(
        v for v in kvgate_deployment(docs)["spec"]["template"]["spec"]["volumes"] if "secret" in v
    )
    assert volume["secret"]["secretName"] == secret_name
    assert {i["key"] for i in volume["secret"]["items"]} <= data.keys()


def test_example_credentials_only_in_the_simulated_overlay(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    assert not any(d["kind"] == "Secret" for d in rendered["base"])
    example = secret_data(rendered["simulated-engines"])
    production = secret_data(rendered["production"])
    assert "do-not-use" in example["admin-token"]
    assert not any("do-not-use" in value for value in production.values())


def test_redis_store_is_set_only_where_redis_is_deployed(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def store_url(docs: list[dict[str, Any]]) -> str | None:
        env = container(kvgate_deployment(docs), "kvgate")["env"]
        return next((e["value"] for e in env if e["name"] == "KVGATE_STORE__URL"), None)

    production = rendered["production"]
    redis = find(production, "Service", "redis")
    [redis_port] = [p["port"] for p in redis["spec"]["ports"]]
    assert store_url(production) == f"redis://redis:{redis_port}/0"
    redis_pods = find(production, "Deployment", "redis")["spec"]["template"]["metadata"]
    assert redis["spec"]["selector"].items() <= redis_pods["labels"].items()
    assert container(find(production, "Deployment", "redis"), "redis")["image"].startswith(
        "docker.io/library/redis:7"
    )
    policy = find(production, "NetworkPolicy", "redis")
    kvgate_labels = kvgate_deployment(production)["spec"]["template"]["metadata"]["labels"]
    [allowed] = policy["spec"]["ingress"][0]["from"]
    assert allowed["podSelector"]["matchLabels"].items() <= kvgate_labels.items()
    for name in ("base", "simulated-engines"):
        assert store_url(rendered[name]) is None
        assert not any(d["metadata"]["name"] == "redis" for d in rendered[name])


def test_simulated_engines_are_what_the_headless_service_selects(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["simulated-engines"]
    engines = find(docs, "Service", "vllm-engines")
    sim = find(docs, "Deployment", "vllm-sim")
    sim_labels = sim["spec"]["template"]["metadata"]["labels"]
    assert engines["spec"]["selector"].items() <= sim_labels.items()
    engine = container(sim, "sim")
    assert engine["command"] == ["kvgate", "sim"]
    args = engine["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert int(args[args.index("--port") + 1]) == engines["spec"]["ports"][0]["targetPort"]


def test_images_name_this_release(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The tag is kvgate's version (what deploy/container/build.sh tags by default)."""
    version = importlib.metadata.version("kvgate")
    expected = {
        "base": f"localhost/kvgate:{version}",
        "simulated-engines": f"localhost/kvgate:{version}",
        "production": f"registry.example.com/kvgate:{version}",
    }
    for name, image in expected.items():
        kvgate_images = {
            c["image"]
            for d in rendered[name]
            if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"
            for c in containers(d)
        }
        assert kvgate_images == {image}, name


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_everything_lands_in_one_namespace(
    rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    for doc in rendered[name]:
        if doc["kind"] == "Namespace":
            assert doc["metadata"]["name"] == NAMESPACE
        else:
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]["name"]
