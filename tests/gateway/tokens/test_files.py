"""Configured tokenizers are read once, by the shell, when the gateway is built.

A model directory (tokenizer.json, tokenizer_config.json with its chat template, or a
chat_template.jinja) or a tokenizer.json alone; anything that cannot be read stops the
start with the model and the path named.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tokens.helpers import TEMPLATE, model_dir, reference_ids, train
from kvgate.config import load_config
from kvgate.gateway.app import Gateway
from kvgate.gateway.tokens.files import TokenizerLoadError, load_tokenizers

TEXT = "the quick brown fox jumps over the lazy dog"
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]}
RENDERED = f"<|system|>\nBe brief.\n<|user|>\n{TEXT}\n<|assistant|>\n"


def test_the_gateway_reads_each_configured_tokenizer_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer = train()
    tokenizer.save(str(path))
    config = load_config(
        backends=[{"url": "http://127.0.0.1:1"}], **{"admission.tokenizers": {"exact": str(path)}}
    )
    counter = Gateway(config).relay.counter
    count = counter.local("exact", {"prompt": TEXT}, chat=False)
    assert count is not None and list(count.ids or ()) == reference_ids(tokenizer, TEXT)
    # A tokenizer.json alone has no chat template: chats are left to the engine.
    assert counter.local("exact", CHAT, chat=True) is None
    # Another model has no tokenizer.
    assert counter.local("other", {"prompt": TEXT}, chat=False) is None


def test_a_model_directory_counts_chats_by_its_template(tmp_path: Path) -> None:
    tokenizer = train()
    loaded = load_tokenizers({"m": str(model_dir(tmp_path / "m", tokenizer))})["m"]
    assert loaded.chat_ids(CHAT) == reference_ids(tokenizer, RENDERED)
    assert loaded.prompt_ids(TEXT) == reference_ids(tokenizer, TEXT)
    assert loaded.chat_ids({**CHAT, "add_generation_prompt": False}) == reference_ids(
        tokenizer, RENDERED.removesuffix("<|assistant|>\n")
    )


def test_a_chat_template_file_wins_and_named_templates_use_the_default(tmp_path: Path) -> None:
    folder = model_dir(tmp_path / "jinja", template=TEMPLATE)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'] }}")
    tokenizer = train()
    loaded = load_tokenizers({"m": str(folder)})["m"]
    assert loaded.chat_ids(CHAT) == reference_ids(tokenizer, "<s>" + TEXT)
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    listed = load_tokenizers({"m": str(model_dir(tmp_path / "named", template=named))})["m"]  # type: ignore[arg-type]
    assert listed.chat_ids(CHAT) == reference_ids(tokenizer, RENDERED)


def test_special_tokens_are_added_as_the_config_states(tmp_path: Path) -> None:
    """`add_bos_token` (as `transformers` applies it) puts `<s>` before a completion's prompt;
    a chat's template writes its own."""
    tokenizer = train()
    bos = tokenizer.token_to_id("<s>")
    with_bos = load_tokenizers({"m": str(model_dir(tmp_path / "b", add_bos_token=True))})["m"]
    assert with_bos.prompt_ids(TEXT) == [bos, *reference_ids(tokenizer, TEXT)]
    assert with_bos.chat_ids(CHAT) == reference_ids(tokenizer, RENDERED)
    without = load_tokenizers({"m": str(model_dir(tmp_path / "n", add_bos_token=False))})["m"]
    assert without.prompt_ids(TEXT) == reference_ids(tokenizer, TEXT)


def test_no_tokenizer_configured_reads_nothing() -> None:
    assert load_tokenizers({}) == {}


@pytest.mark.parametrize(
    "case", ["missing_file", "broken_file", "empty_dir", "bad_config", "bad_template"]
)
def test_an_unreadable_tokenizer_names_the_model_and_the_path(tmp_path: Path, case: str) -> None:
    path = tmp_path / "t"
    if case == "missing_file":
        path = tmp_path / "missing.json"
    elif case == "broken_file":
        path = tmp_path / "broken.json"
        path.write_text("{not json")
    elif case == "empty_dir":
        path.mkdir()
    elif case == "bad_config":
        model_dir(path)
        (path / "tokenizer_config.json").write_text("[1, 2]")
    else:
        model_dir(path, template="{% for m in messages %}")  # never closed
    with pytest.raises(TokenizerLoadError, match=f"{path}.*'exact'"):
        load_tokenizers({"exact": str(path)})


def test_kvgate_serve_refuses_to_start_with_an_unreadable_tokenizer(tmp_path: Path) -> None:
    broken = model_dir(tmp_path / "broken")
    (broken / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    for path in (tmp_path / "missing.json", broken):
        config = tmp_path / "kvgate.yaml"
        config.write_text(f"admission:\n  tokenizers:\n    exact: {path}\n")
        done = subprocess.run(
            [sys.executable, "-m", "kvgate", "serve", "--config", str(config), "--port", "0",
             "--backend", "http://127.0.0.1:1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2
        assert "invalid configuration" in done.stderr
        assert str(path) in done.stderr and "Traceback" not in done.stderr
