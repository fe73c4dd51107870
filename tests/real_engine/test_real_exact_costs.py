"""kvgate counts prompts as the real vLLM does: with the model's tokenizer (its directory,
chat template, special tokens) and, without one, by asking the engine's `/tokenize`.

Each count is compared with the `usage.prompt_tokens` the engine reports for the very
request, and the ids with the engine's own `/tokenize` answer.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvgate.gateway.tokens.counting import PromptCounter
from kvgate.gateway.tokens.files import load_tokenizers
from real_engine.conftest import GatewayFactory
from real_engine.engine import MODEL_NAME, ServerProcess, install_root, record_figure

pytestmark = pytest.mark.real_engine

CODE = 'def main(argv: list[str]) -> int:\n    """Run it."""\n    return len(argv) or 42\n'
PROSE = "It's a café in Zürich; we'll meet at 10:30. Naïve résumé — “quoted” 日本語 🙂\n\n"
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "Hello, world!"},
    {"prompt": CODE * 20},
    {"prompt": PROSE * 10},
    {"prompt": "a  b   c\n\n\n  d\t\te \r\n f" * 30},
    {"prompt": "<s> special </s> tokens <unk> inside\n" * 5},
]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi!"}]},
    {
        "messages": [
            {"role": "system", "content": "You are a careful assistant.\n" * 10},
            {"role": "user", "content": CODE * 5},
            {"role": "assistant", "content": PROSE},
            {"role": "user", "content": "And then?"},
        ]
    },
    {"messages": [{"role": "user", "content": PROSE}], "add_generation_prompt": False},
]


def _model_dir() -> str:
    return str(install_root() / "tiny-llama")


async def _usage(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> int:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answer = await client.post(url + path, json={**body, "model": MODEL_NAME, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


async def test_the_tokenizer_counts_what_the_engine_counts(idle_engine: ServerProcess) -> None:
    counter = PromptCounter(load_tokenizers({MODEL_NAME: _model_dir()}))
    tokenizer = counter.tokenizers[MODEL_NAME]
    record_figure("exact-costs tokenizer path", tokenizer.describe())
    async with httpx.AsyncClient(timeout=60.0) as client:
        for body in [*COMPLETIONS, *CHATS]:
            chat = "messages" in body
            count = counter.local(MODEL_NAME, body, chat)
            assert count is not None, body
            engine = await client.post(
                idle_engine.url + "/tokenize", json={"model": MODEL_NAME, **body}
            )
            assert engine.status_code == 200, engine.text
            assert list(count.ids or ()) == engine.json()["tokens"], body
            assert count.per_prompt[0] == await _usage(client, idle_engine.url, body), body


async def _costs(client: httpx.AsyncClient, gateway: ServerProcess) -> dict[str, Any]:
    state = (await client.get(gateway.url + "/admin/state")).json()
    return dict(state["costs"])


@pytest.mark.parametrize("configured", [True, False])
async def test_through_kvgate_the_counts_agree_with_the_engine(
    start_gateway: GatewayFactory, configured: bool
) -> None:
    """With the tokenizer configured, no count disagrees with the engine's usage (a
    disagreement would drop the tokenizer); without, the engine's `/tokenize` counts."""
    settings = {"admission__tokenizers": json.dumps({MODEL_NAME: _model_dir()})}
    gateway = start_gateway(**(settings if configured else {}))
    async with httpx.AsyncClient(timeout=60.0) as client:
        for body in [*COMPLETIONS, *CHATS] * 2:
            await _usage(client, gateway.url, body)
        costs = await _costs(client, gateway)
    if configured:
        assert set(costs["tokenizers"]) == {MODEL_NAME}
        assert costs["distrusted"] == []
        assert costs["engine"]["asked"] == 0
    else:
        assert costs["tokenizers"] == {}
        engine = costs["engine"]
        assert engine["asked"] == engine["answered"] == 2 * len(COMPLETIONS + CHATS)
