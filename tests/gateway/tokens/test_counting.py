"""The order of the ways to count a prompt, through a running gateway: token ids as sent,
the model's tokenizer, the engine's `/tokenize`, the estimate; a count that comes late
re-costs the waiting request; a tokenizer the engine contradicts is dropped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from gateway.test_admission import OneAtATime, RecordingPolicy
from gateway.tokens.helpers import model_dir, reference_ids, train
from kvgate.core.admission import Decision, Reject
from kvgate.core.cost import CostBasis
from kvgate.core.request import AdmissionRequest
from kvgate.gateway.tokens.counting import STRIKES, PromptCounter
from kvgate.gateway.tokens.engine import EngineCounter
from kvgate.testing import FakeEngine, eventually

TEXT = "the quick brown fox jumps over the lazy dog " * 10


class Requests(RecordingPolicy):
    """Keeps every admitted request whole."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, AdmissionRequest] = {}

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        decision = super().admit(request, promised)
        if not isinstance(decision, Reject):
            self.requests[request.request_id] = request
        return decision


def tokenize_calls(engine: FakeEngine) -> int:
    return sum(1 for r in engine.requests if r.path == "/tokenize")


async def test_each_prompt_is_counted_the_best_way_available(
    engine_factory, gateway_factory, tmp_path: Path
) -> None:
    counting = await engine_factory(models=["tok-model"], tokenize=True)
    silent = await engine_factory(model="silent-model")  # no /tokenize: a 404
    tokenizer = train()
    policy = Requests()
    gw = await gateway_factory(
        [counting.url, silent.url],
        policy=policy,
        overrides={"admission.tokenizers": {"tok-model": str(model_dir(tmp_path, tokenizer))}},
    )
    chat = [{"role": "user", "content": TEXT}]
    sends = [
        ("by-tokenizer", "/v1/chat/completions", {"model": "tok-model", "messages": chat}),
        ("by-engine", "/v1/completions", {"model": "fake-model", "prompt": TEXT}),
        ("by-ids", "/v1/completions", {"model": "fake-model", "prompt": [5, 6, 7]}),
        ("estimated", "/v1/completions", {"model": "silent-model", "prompt": TEXT}),
        ("estimated-2", "/v1/completions", {"model": "silent-model", "prompt": TEXT}),
    ]
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for rid, path, body in sends:
            response = await client.post(
                path, json={**body, "max_tokens": 3}, headers={"x-request-id": rid}
            )
            assert response.status_code == 200, response.text
    seen = policy.requests
    rendered = f"<|user|>\n{TEXT}\n<|assistant|>\n"
    assert seen["by-tokenizer"].prompt_ids == tuple(reference_ids(tokenizer, rendered))
    assert seen["by-engine"].prompt_ids == tuple(range(100, 100 + len(TEXT) // 4))
    assert seen["by-ids"].prompt_ids == (5, 6, 7)
    for rid in ("by-tokenizer", "by-engine", "by-ids"):
        cost = seen[rid].cost
        assert cost.prompt_exact and cost.prompt_tokens == len(seen[rid].prompt_ids or ())
    estimated = seen["estimated"]
    assert estimated.prompt_ids is None and not estimated.cost.prompt_exact
    # Only the engine's count was asked for, once; the engine without one, once in all.
    assert tokenize_calls(counting) == 1
    assert tokenize_calls(silent) == 1
    async with httpx.AsyncClient(base_url=gw.url) as client:
        costs = (await client.get("/admin/state")).json()["costs"]
    assert costs["engine"]["skipped"] == [silent.url.removeprefix("http://")]
    assert set(costs["tokenizers"]) == {"tok-model"}
    assert set(costs["chars_per_token"]) == {"tok-model", "fake-model", "silent-model"}


async def test_a_count_that_comes_late_recosts_the_waiting_request(
    engine_factory, gateway_factory
) -> None:
    """The engine's `/tokenize` answers after 0.4 s, the gateway waits 0.1 s for it: the
    request is costed by the estimate and waits; the count re-costs it where it waits, and
    it starts with its exact cost and ids."""
    engine = await engine_factory(tokenize=True, tokenize_delay=0.4)
    policy = OneAtATime()
    gw = await gateway_factory([engine.url], policy=policy)
    admission = gw.gateway.admission
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": [1], "fake": {"delay": 1.5}},
                headers={"x-request-id": "first"},
            )
        )
        assert await eventually(lambda: len(policy.admitted) == 1, 5.0)
        second = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": TEXT, "max_tokens": 5},
                headers={"x-request-id": "second"},
            )
        )
        assert await eventually(lambda: admission.waiting == 1, 5.0)
        [waiter] = admission.queue.waiting()
        assert not waiter.request.cost.prompt_exact  # the estimate, while the count is due
        estimated = waiter.request.cost.prompt_tokens
        assert await eventually(lambda: waiter.request.cost.prompt_exact, 5.0)
        assert waiter.waiting and waiter.request.prompt_ids is not None
        assert (await first).status_code == 200
        assert (await second).status_code == 200
    [(_, cost, _)] = [a for a in policy.admitted if a[0] == "second"]
    assert cost.prompt_exact and cost.prompt_tokens == len(TEXT) // 4 < estimated
    assert gw.gateway.relay.recosting.recosted == 1


def test_a_tokenizer_the_engine_contradicts_is_no_longer_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvgate.gateway.tokens.files import load_tokenizers

    counter = PromptCounter(load_tokenizers({"m": str(model_dir(tmp_path))}))
    body = {"prompt": TEXT}
    count = counter.local("m", body, chat=False)
    assert count is not None
    basis = CostBasis("m", ((count.per_prompt[0], 0),), source="tokenizer")
    counter.check(basis, False, count.per_prompt[0])  # agrees
    with caplog.at_level(logging.ERROR):
        for _ in range(STRIKES - 1):
            counter.check(basis, False, count.per_prompt[0] + 2)
        assert counter.local("m", body, chat=False) is not None  # not yet
        counter.check(basis, False, count.per_prompt[0] + 2)
    assert counter.local("m", body, chat=False) is None
    assert counter.local("m", {"messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert "check admission.tokenizers" in caplog.text
    assert counter.snapshot()["distrusted"] == ["m prompt"]


def test_what_is_asked_of_the_engine() -> None:
    from kvgate.gateway.relay.upstream import UpstreamPool

    engines = EngineCounter(UpstreamPool([]))
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
        "tools": [{"type": "function"}],
        "max_tokens": 5,
        "stream": True,
    }
    asked = engines.request_body("m", chat)
    assert asked is not None and b'"max_tokens"' not in asked and b'"stream"' not in asked
    assert b'"add_generation_prompt":false' in asked and b'"tools"' in asked
    assert engines.request_body("m", {"prompt": ["one"]}) == b'{"model":"m","prompt":"one"}'
    assert engines.request_body("m", {"prompt": ["one", "two"]}) is None  # a batch
    assert engines.request_body("m", {"prompt": [1, 2]}) is None  # ids count themselves
    assert engines.backend_for(("nowhere",)) is None


async def test_a_count_that_comes_after_the_start_recosts_the_running_request(
    engine_factory, gateway_factory
) -> None:
    """The engine's `/tokenize` answers after 0.4 s, the request starts at once on the
    estimate and runs 4 s (ten times the count's delay, so that the count comes while it
    runs on a loaded machine too): the ticket takes the exact cost and the ids, and its
    release leaves nothing held."""
    engine = await engine_factory(tokenize=True, tokenize_delay=0.4)
    policy = RecordingPolicy()
    gw = await gateway_factory([engine.url], policy=policy)
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        running = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"model": "fake-model", "prompt": TEXT, "fake": {"delay": 4.0}},
                headers={"x-request-id": "running"},
            )
        )
        assert await eventually(lambda: len(policy.admitted) == 1, 5.0)
        [(_, estimated, _)] = policy.admitted
        assert not estimated.prompt_exact
        [hold] = policy.holds.live.values()
        ticket = hold.ticket
        assert await eventually(lambda: ticket.request.cost.prompt_exact, 5.0)
        assert not running.done()  # counted while it runs
        assert ticket.request.prompt_ids == tuple(range(100, 100 + len(TEXT) // 4))
        assert hold.prompt == len(TEXT) // 4 < estimated.prompt_tokens
        assert (await running).status_code == 200
    assert gw.gateway.relay.recosting.recosted == 1
    assert policy.in_flight_requests == 0 and not policy.holds.live
