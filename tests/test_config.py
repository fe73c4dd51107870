"""The config loads from YAML, the environment overrides it, and flags override both."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvgate.config import load_config
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
    with pytest.raises(ValidationError, match="high_watermark"):
        load_config(path)
    path.write_text("admission: {polcy: seed}\n")
    with pytest.raises(ValidationError, match="polcy"):
        load_config(path)


def test_reference_table_names_every_section() -> None:
    table = reference_table()
    for key in ("server.port", "backends[].url", "admission.high_watermark", "scrape.interval_s"):
        assert f"`{key}`" in table


def test_readme_reference_is_generated_from_the_model() -> None:
    """The README's config table is `kvgate config-doc --update README.md`'s output."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert with_reference(text) == text, "run: kvgate config-doc --update README.md"
