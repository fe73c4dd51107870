"""The simulator's `/tokenize` counts what its engine counts, as vLLM's does; its
completions without `max_tokens` stop at vLLM's 16."""

from __future__ import annotations

import httpx
import pytest

from kvgate.sim.server import SimServer

pytestmark = pytest.mark.timeout(60)

BODIES = [
    {"prompt": "hello " * 100},
    {"prompt": ["a single prompt in a list, as clients send it"]},
    {"prompt": list(range(7, 57))},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "x" * 333},
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts " * 20}]}]},
]


@pytest.mark.parametrize("body", BODIES)
async def test_tokenize_counts_what_usage_reports(sim_server: SimServer, body: dict) -> None:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim_server.port}") as http:
        counted = await http.post("/tokenize", json={"model": "sim-llama", **body})
        again = await http.post("/tokenize", json={"model": "sim-llama", **body})
        served = await http.post(route, json={"model": "sim-llama", "max_tokens": 2, **body})
    assert counted.status_code == 200 and served.status_code == 200, served.text
    answer = counted.json()
    assert answer["count"] == len(answer["tokens"]) == served.json()["usage"]["prompt_tokens"]
    assert answer["max_model_len"] == sim_server.engine.config.max_model_len
    assert again.json()["tokens"] == answer["tokens"]  # the same text, the same ids
    if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], int):
        assert answer["tokens"] == body["prompt"]


async def test_shared_text_gives_shared_ids(sim_server: SimServer) -> None:
    """Two prompts that share their first 400 characters share their first 100 ids."""
    shared = "".join(chr(97 + i % 26) for i in range(400))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim_server.port}") as http:
        one = (await http.post("/tokenize", json={"prompt": shared + "one"})).json()["tokens"]
        two = (await http.post("/tokenize", json={"prompt": shared + "two!"})).json()["tokens"]
    assert one[:100] == two[:100] and one[100:] != two[100:]


async def test_tokenize_refuses_what_a_request_would_be_refused_for(sim_server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim_server.port}") as http:
        other = await http.post("/tokenize", json={"model": "other", "prompt": "x"})
        bad = await http.post("/tokenize", json={"model": "sim-llama", "prompt": 3})
    assert other.status_code == 404 and bad.status_code == 400
    assert bad.json()["error"]["param"] == "prompt"


async def test_a_completion_without_max_tokens_generates_16_as_vllm_does(
    sim_server: SimServer,
) -> None:
    """vLLM's completions default to OpenAI's 16 tokens (clamped at the context's end);
    only its chats run to the end of the context."""
    limit = sim_server.engine.config.max_model_len
    body = {"model": "sim-llama", "ignore_eos": True}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sim_server.port}") as http:
        short = await http.post("/v1/completions", json={**body, "prompt": [1] * 10})
        near_end = await http.post("/v1/completions", json={**body, "prompt": [1] * (limit - 5)})
    assert short.json()["usage"]["completion_tokens"] == 16
    assert near_end.json()["usage"]["completion_tokens"] == 5
