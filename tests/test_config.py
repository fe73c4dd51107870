"""The config loads from YAML, the environment overrides it, and flags override both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.config import ConfigError, load_config
from kvgate.config_doc import reference_table, with_reference


def test_bare_backend_url_is_a_vllm_engine(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "backends:\n  - http://127.0.0.1:8000\n  - {url: 'http://h:1', engine: sglang}\n"
    )
    config = load_config(path)
    assert [b.engine for b in config.backends] == ["vllm", "sglang"]


def test_environment_beats_file_and_flags_beat_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server: {port: 7000}\nadmission: {policy: seed}\n")
    monkeypatch.setenv("KVGATE_SERVER__PORT", "7001")
    assert load_config(path).server.port == 7001
    assert load_config(path).admission.policy == "seed"
    assert load_config(path, **{"server.port": 7002}).server.port == 7002


def test_bad_values_are_refused_with_the_key_named(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("admission: {high_watermark: 7.3}\n")
    expected = r"^admission\.high_watermark: .*less than 1 \(got 7\.3\)$"
    with pytest.raises(ConfigError, match=expected):
        load_config(path)
    path.write_text("admission: {polcy: seed}\n")
    with pytest.raises(ConfigError, match="polcy"):
        load_config(path)


def test_a_secret_is_never_repeated_in_an_error(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("auth: {keys: [{key: tooshort-secret, tenant: a}]}\n")
    with pytest.raises(ConfigError, match=r"auth\.keys\.0\.key") as caught:
        load_config(path)
    assert "tooshort-secret" not in str(caught.value)


def _serve(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`kvgate serve ARGS` as a user runs it (it must exit at once: the input is wrong)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("file_text", "args", "env", "expected"),
    [
        ("backends: [http://a:1\n  - x: ]\n", (), {}, "kvgate.yaml:2:6: not valid YAML"),
        ("- just\n- a list\n", (), {}, "the top level of a config file must be a mapping"),
        ("backends: [127.0.0.1:8000]\n", (), {}, "backends.0.url: '127.0.0.1:8000' is not a URL"),
        (None, ("--backend", "127.0.0.1:8000"), {}, "'127.0.0.1:8000' is not a URL"),
        (None, ("--config", "missing.yaml"), {}, "cannot read missing.yaml"),
        (None, (), {"KVGATE_BACKENDS": "http://a:1"}, "lists and sections are given as JSON"),
        ("server: {port: 99999, log_format: xml}\n", (), {}, "2 problems:\n  server.port"),
        (None, ("--metrics-listen", "9464"), {}, "'9464' is not HOST:PORT"),
        (None, ("--certfile", "no.pem", "--keyfile", "no.key"), {}, "TLS: [Errno 2]"),
    ],
)
def test_configuration_mistakes_are_one_clear_line_and_exit_2(
    tmp_path: Path,
    file_text: str | None,
    args: tuple[str, ...],
    env: dict[str, str],
    expected: str,
) -> None:
    if file_text is not None:
        (tmp_path / "kvgate.yaml").write_text(file_text)
        args = ("--config", "kvgate.yaml", *args)
    done = _serve(*args, cwd=tmp_path, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kvgate serve: invalid configuration: "), done.stderr
    assert expected in done.stderr
    assert "Traceback" not in done.stderr and "errors.pydantic.dev" not in done.stderr


def test_reference_table_names_every_section() -> None:
    table = reference_table()
    for key in ("server.port", "backends[].url", "admission.high_watermark", "scrape.interval_s"):
        assert f"`{key}`" in table


def test_readme_reference_is_generated_from_the_model() -> None:
    """The README's config table is `kvgate config-doc --update README.md`'s output."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert with_reference(text) == text, "run: kvgate config-doc --update README.md"
