"""deploy/: the Grafana dashboard, the Prometheus scrape example and the alerting rules.

Every query must name a metric that kvgate or vLLM really exports: kvgate's are read from
a live gateway's `/metrics`, vLLM's from a real engine's page
(`tests/adapters/pages/vllm.txt`).
With `promtool` installed (Debian's `prometheus` package) the config, the rules, the
rules' unit tests and every dashboard query are also checked by Prometheus itself.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from opview_synthetic import serve

from kvgate.config import KvgateConfig
from kvgate.gateway.app import Gateway

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "kvgate-alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "kvgate-alerts.test.yml"
VLLM_PAGES = (
    ROOT.parent / "shared" / "real-vllm" / "metrics_sample.txt",
    ROOT / "tests" / "adapters" / "pages" / "vllm.txt",  # a committed copy of that page
)

_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$node": ".*"}
# kube-state-metrics' series an alert may compare with (each with a fallback when absent).
KUBE_STATE_METRICS = {"kube_deployment_spec_replicas"}


# ---------------------------------------------------------------- what is exported


def exposition_names(text: str) -> set[str]:
    """Every series name a Prometheus text page can produce (samples and declared types)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
            elif kind == "summary":
                names.update({f"{name}_sum", f"{name}_count"})
            elif kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def kvgate_names() -> Iterator[set[str]]:
    """Names on a live gateway's /metrics (one backend that never answers: the scraper and
    the policy still publish their per-node families; a store that never answers: the
    replica, isolated, still publishes the store's)."""
    config = KvgateConfig(
        backends=[{"url": "http://127.0.0.1:9", "name": "n0"}],
        store={"url": "redis://127.0.0.1:9/0"},
    )
    with serve(Gateway(config)) as url:
        text = httpx.get(url + "/metrics", timeout=10).text
    names = exposition_names(text)
    assert "kvgate_admissions_total" in names  # the page really is kvgate's
    assert "kvgate_store_up" in names
    yield names


@pytest.fixture(scope="module")
def vllm_names() -> set[str]:
    for page in VLLM_PAGES:
        if page.exists():
            return exposition_names(page.read_text(encoding="utf-8"))
    pytest.fail(f"no real vLLM metrics page found at {[str(p) for p in VLLM_PAGES]}")


# ---------------------------------------------------------------- what is queried


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    for variable, value in _GRAFANA_VARS.items():
        expr = expr.replace(variable, value)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if rest.startswith("(") or match.group(0).lower() in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    queries = [
        target["expr"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and isinstance(query, str):
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", query.strip())
            queries.append(match.group(1) if match else query)
    return queries


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{node=~"$node"}[$__rate_interval])))'
        " / clamp_min(sum(rate(b_total[5m])), 1e-9) > 0.2 and min(vllm:x) > 1 or vector(0)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "vllm:x"}


# ---------------------------------------------------------------- the tests


def test_dashboard_json_is_the_generators_output() -> None:
    spec = importlib.util.spec_from_file_location(
        "grafana_generate", DASHBOARD.with_name("generate.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text(encoding="utf-8") == module.render(), (
        "deploy/grafana/kvgate-dashboard.json is stale: run python deploy/grafana/generate.py"
    )


def test_dashboard_is_well_formed_grafana_json() -> None:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "node"} <= variables
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].strip()
    titles = " ".join(panel["title"] for panel in board["panels"]).lower()
    for topic in ("rejected", "queue", "predicted", "stale", "sample age", "cancel"):
        assert topic in titles or topic in json.dumps(board).lower(), topic


def test_every_query_names_an_exported_metric(kvgate_names: set[str], vllm_names: set[str]) -> None:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exported = kvgate_names | vllm_names | KUBE_STATE_METRICS
    queried: set[str] = set()
    for expr in dashboard_queries(board) + alert_queries():
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{sorted(missing)} in {expr!r} is exported by neither"
        queried |= names
    # Both sources are really used.
    assert any(n.startswith("kvgate_") for n in queried)
    assert any(n.startswith("vllm:") for n in queried)


def test_alert_rules_cover_the_three_incidents() -> None:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    by_name = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    for name in (
        "KvgateSaturationSustained",
        "KvgateAllNodesStale",
        "KvgateCancellationPropagationSlow",
    ):
        rule = by_name[name]
        assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_scrape_config_scrapes_kvgate_and_vllm_and_loads_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {"kvgate", "vllm"} <= set(jobs)
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    relabel = jobs["vllm"]["relabel_configs"][0]
    assert relabel["target_label"] == "node"  # joins vLLM's series to kvgate's per node
    for rule_file in config["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).exists()


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (apt-get install -y prometheus)"
)


def _promtool(*args: str, cwd: Path = DEPLOY / "prometheus") -> None:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_accepts_config_and_rules_and_their_unit_tests_pass() -> None:
    _promtool("check", "config", "prometheus.yml")
    _promtool("check", "rules", "kvgate-alerts.yml")
    _promtool("test", "rules", "kvgate-alerts.test.yml")


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each panel query, with Grafana's variables filled in, as a recording rule."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    rules = []
    for i, expr in enumerate(dashboard_queries(board)):
        for variable, value in _GRAFANA_VARS.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"kvgate:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}), "utf-8")
    _promtool("check", "rules", str(path), cwd=tmp_path)
