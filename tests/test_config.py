"""The config loads from YAML, the environment overrides it, and flags override both."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.config import RETIRED, ConfigError, load_config
from kvgate.config_doc import reference_table, with_reference
from kvgate.gateway.cli import _listen_flags


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
    path.write_text("server: {listen: '0.0.0.0:7000'}\nadmission: {fail_mode: open}\n")
    monkeypatch.setenv("KVGATE_SERVER__LISTEN", "127.0.0.1:7001")
    assert load_config(path).server.address == ("127.0.0.1", 7001)
    assert load_config(path).admission.fail_mode == "open"
    assert load_config(path, **{"server.listen": "[::1]:7002"}).server.address == ("::1", 7002)


def test_bad_values_are_refused_with_the_key_named(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("admission: {high_watermark: 7.3}\n")
    expected = r"^admission\.high_watermark: .*less than 1 \(got 7\.3\)$"
    with pytest.raises(ConfigError, match=expected):
        load_config(path)
    path.write_text("admission: {polcy: seed}\n")
    with pytest.raises(ConfigError, match="polcy"):
        load_config(path)


@pytest.mark.parametrize("key", sorted(RETIRED))
def test_a_retired_key_is_refused_with_where_its_value_belongs(key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, **{key: 1})
    assert str(caught.value).startswith(f"{key}: not a setting: {RETIRED[key]}")


def test_old_keys_name_their_replacement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("auth: {default_tenant_limits: {max_in_flight_tokens: 5000}}\n")
    with pytest.raises(ConfigError, match=r'^auth\.default_tenant_limits: .*"\*" of auth\.tenants'):
        load_config(path)
    path.write_text("admission: {policy: static-qps}\n")
    with pytest.raises(ConfigError, match=r"^admission\.policy: .*adaptive policy only"):
        load_config(path)
    monkeypatch.setenv("KVGATE_SERVER__HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match=r"^server\.host: .*server\.listen: HOST:PORT"):
        load_config(None)


@pytest.mark.parametrize(
    ("listen", "address"),
    [("0.0.0.0:8080", ("0.0.0.0", 8080)), ("[::]:8000", ("::", 8000)),
     ("[::1]:0", ("::1", 0)), ("gw.internal:443", ("gw.internal", 443))],
)  # fmt: skip
def test_listen_is_host_colon_port(listen: str, address: tuple[str, int]) -> None:
    assert load_config(None, **{"server.listen": listen}).server.address == address


@pytest.mark.parametrize("listen", ["8080", "localhost", "::1:8080", "[h]:80", "h:", "h:99999"])
def test_a_listen_that_is_not_host_colon_port_is_a_clear_error(listen: str) -> None:
    expected = rf"^server\.listen: '{re.escape(listen)}' is not HOST:PORT \(e\.g\. 0\.0\.0\.0:8080"
    with pytest.raises(ConfigError, match=expected):
        load_config(None, **{"server.listen": listen})


def test_host_and_port_flags_change_one_half_of_listen(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server: {listen: '[::1]:9000'}\n")

    def flags(host: str | None, port: int | None) -> str | None:
        return _listen_flags(argparse.Namespace(config=str(path), host=host, port=port))

    assert flags(None, None) is None  # the configured address as it is
    assert flags("0.0.0.0", None) == "0.0.0.0:9000"
    assert flags(None, 0) == "[::1]:0"
    assert flags("::", 8080) == "[::]:8080"


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


_BAD_LEVEL = (
    "server.log_level: Input should be 'debug', 'info', 'warning', 'error' or 'critical'"
    " (got 'verbose')"
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
        (
            "server: {listen: '127.0.0.1:99999', log_format: xml}\n",
            (),
            {},
            "2 problems:\n  server.listen",
        ),
        (None, ("--metrics-listen", "9464"), {}, "'9464' is not HOST:PORT"),
        (None, ("--port", "70000"), {}, "server.listen: '127.0.0.1:70000' is not HOST:PORT"),
        (
            None,
            (),
            {"KVGATE_SERVER__PORT": "9000"},
            "server.port: not a setting: give `server.listen",
        ),
        ("admission: {seed: 7}\n", (), {}, "admission.seed: not a setting"),
        (
            None,
            ("--certfile", "/nonexistent.pem", "--keyfile", "no.key"),
            {},
            "server.certfile: cannot read /nonexistent.pem: No such file or directory",
        ),
        (None, ("--log-level", "verbose"), {}, _BAD_LEVEL),
        (None, (), {"KVGATE_SERVER__LOG_LEVEL": "verbose"}, _BAD_LEVEL),
        ("server: {log_level: verbose}\n", (), {}, _BAD_LEVEL),
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


def test_the_key_count_stays_small() -> None:
    rows = [line for line in reference_table().splitlines() if line.startswith("| `")]
    assert len(rows) <= 40
    assert len([row for row in rows if row.startswith("| `admission.")]) < 20


def test_reference_table_names_every_section() -> None:
    table = reference_table()
    for key in ("server.listen", "backends[].url", "admission.high_watermark", "scrape.interval_s"):
        assert f"`{key}`" in table


def test_readme_reference_is_generated_from_the_model() -> None:
    """The README's config table is `kvgate config-doc --update README.md`'s output."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert with_reference(text) == text, "run: kvgate config-doc --update README.md"
