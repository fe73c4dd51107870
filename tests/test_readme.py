"""What the README and the docs promise a newcomer, checked against the code and the tree."""

from __future__ import annotations

import re
from pathlib import Path

from kvgate.config import load_config
from kvgate.gateway.app import Gateway
from kvgate.gateway.ops.dashboard import STATIC_PREFIX

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts/real-vllm/README.md"]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start : end if end > 0 else None]


def test_the_route_table_lists_every_route_a_gateway_serves() -> None:
    config = load_config(None, backends=[{"url": "http://127.0.0.1:9"}])
    served = set()
    for method, path in Gateway(config).routes:
        if path == "/dashboard/":  # the same page as /dashboard
            continue
        if path.startswith(STATIC_PREFIX):
            path = STATIC_PREFIX + "*"
        served.add(f"{method} {path}")
    table = _section(README.read_text(), "### Routes, keys and what each route shows")
    documented = set(re.findall(r"`((?:GET|POST) /[^`]*)`", table))
    assert documented == served
    assert "any other `/v1/*`" in table and "passed through" in table


def test_docs_point_only_inside_the_repository() -> None:
    """Every relative link resolves to a file of the repository; nothing names a path
    beside it (a user of the repository has nothing else)."""
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "/work/" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            resolved = (doc.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (doc, target)


def test_the_readme_names_what_ci_installs() -> None:
    """`.ci/run`'s system packages, as the README's test paragraph promises."""
    script = (ROOT / ".ci/run").read_text().replace("\\\n", " ")
    packages = set()
    for line in script.splitlines():
        if "apt-get install" in line:
            words = line.split("apt-get install", 1)[1].split(">", 1)[0].split()
            packages |= {w for w in words if not w.startswith("-")}
    assert {"chromium", "prometheus", "podman"} <= packages
    tests = _section(README.read_text(), "## Development")
    assert [name for name in sorted(packages) if f"`{name}`" not in tests] == []
    assert "Chromium and promtool" in tests and "scripts/install-real-vllm.sh" in tests
    assert "pip install -e '.[test]' && python -m pytest -q " in tests


def test_the_quick_start_is_for_a_user_and_names_what_kubernetes_needs_first() -> None:
    """CI's machinery is in Development, not before Why; the Kubernetes one-liner says that
    the production overlay needs its secrets written first, and where that is told."""
    text = README.read_text()
    quick = text[text.index("## Quick start") : text.index("## Why")]
    for internal in (".ci/run", "mmdebstrap", "netavark", "promtool", "slirp4netns"):
        assert internal not in quick, internal
    kube = " ".join(quick[quick.index("On Kubernetes") :].split())
    production = kube.index("kubectl apply -k deploy/kubernetes/overlays/production")
    assert "secrets" in kube[production : production + 400]
    assert "docs/kubernetes.md#3-deploy-in-front-of-your-engines" in kube
    guide = (ROOT / "docs/kubernetes.md").read_text()
    assert "## 3. Deploy in front of your engines: `overlays/production`" in guide
    assert "2. **Credentials.** Write them into the overlay's `secrets/`" in guide


def test_no_doc_signals_every_gateway_on_the_host() -> None:
    """`pkill -f "kvgate serve"` or `killall` would reach every gateway of the host."""
    for doc in DOCS:
        text = doc.read_text()
        assert "pkill" not in text and "killall" not in text, doc
