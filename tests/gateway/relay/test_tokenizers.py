"""Configured tokenizers are read once, by the shell, when the gateway is built.

The core's estimator is handed them loaded (see tests/core/test_cost.py for the counts);
what the shell owes is reading the files, and refusing to start, with the model and the
path named, when one cannot be read.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from core.test_cost import train_tokenizer

from kvgate.config import load_config
from kvgate.gateway.app import Gateway
from kvgate.gateway.relay.tokenizers import TokenizerLoadError, load_tokenizers

TEXT = "the quick brown fox jumps over the lazy dog"


def test_the_gateway_reads_each_configured_tokenizer_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer = train_tokenizer()
    tokenizer.save(str(path))
    config = load_config(
        backends=[{"url": "http://127.0.0.1:1"}], **{"admission.tokenizers": {"exact": str(path)}}
    )
    estimator = Gateway(config).relay.estimator
    exact = estimator.estimate("exact", {"prompt": TEXT}).prompt_tokens
    assert exact == len(tokenizer.encode(TEXT).ids)
    # Another model has no tokenizer: its count is the estimate, padded for safety.
    assert estimator.estimate("other", {"prompt": TEXT}).prompt_tokens > exact


def test_no_tokenizer_configured_reads_nothing() -> None:
    assert load_tokenizers({}) == {}


def test_an_unreadable_file_names_the_model_and_the_path(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path in (tmp_path / "missing.json", broken):
        with pytest.raises(TokenizerLoadError, match=f"{path}.*'exact'"):
            load_tokenizers({"exact": str(path)})


def test_kvgate_serve_refuses_to_start_with_an_unreadable_tokenizer(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    config = tmp_path / "kvgate.yaml"
    config.write_text(f"admission:\n  tokenizers:\n    exact: {missing}\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--config", str(config), "--port", "0",
         "--backend", "http://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "invalid configuration" in done.stderr
    assert str(missing) in done.stderr and "Traceback" not in done.stderr
