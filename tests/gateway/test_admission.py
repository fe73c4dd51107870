"""The shell's side of admission: rejections, tickets released exactly once, priorities,
and requests that wait in the gateway's queue (admitted when room frees, gone when their
client leaves)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping

import httpx
import openai
import pytest

from gateway.helpers import RawClient, openai_error
from kvgate.core.admission import Decision, Outcome, Reject, StartEstimate, Ticket
from kvgate.core.clock import MonotonicClock
from kvgate.core.policies.baselines import NonePolicy
from kvgate.core.request import AdmissionRequest, Priority, RequestCost
from kvgate.core.settings import AdmissionSettings
from kvgate.testing import FakeEngine, eventually


class RecordingPolicy(NonePolicy):
    """The real `none` policy, recording every call the gateway makes."""

    def __init__(self, shed: set[Priority] | None = None) -> None:
        super().__init__(AdmissionSettings(), MonotonicClock(), rng_seed=1)
        self.shed = shed or set()
        self.admitted: list[tuple[str, RequestCost, Priority]] = []
        self.releases: Counter[Ticket] = Counter()  # tickets hash by identity
        self.outcomes: dict[str, Outcome] = {}
        self.first_tokens: set[str] = set()
        self.tokens: dict[str, int] = {}

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        if request.priority in self.shed:
            return Reject(429, "test_shed", 2.4, "Shed by the test policy.")
        return super()._decide(now, request, expected, promised)

    def admit(
        self, request: AdmissionRequest, promised: Mapping[str, float] | None = None
    ) -> Decision:
        decision = super().admit(request, promised)
        if not isinstance(decision, Reject):
            self.admitted.append((request.request_id, request.cost, request.priority))
        return decision

    def on_first_token(self, ticket: Ticket) -> None:
        self.first_tokens.add(ticket.request_id)
        super().on_first_token(ticket)

    def on_tokens(self, ticket: Ticket, output_tokens: int) -> None:
        self.tokens[ticket.request_id] = output_tokens
        super().on_tokens(ticket, output_tokens)

    def release(self, ticket: Ticket, outcome: Outcome) -> None:
        self.releases[ticket] += 1
        self.outcomes[ticket.request_id] = outcome
        super().release(ticket, outcome)


async def test_rejection_is_a_429_with_retry_after(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    policy = RecordingPolicy(shed={Priority.SHEDDABLE})
    gw = await gateway_factory([fake_engine.url], policy=policy)
    body = {"model": "fake-model", "prompt": "p"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        shed = await client.post(
            "/v1/completions", json=body, headers={"X-Kvgate-Priority": "sheddable"}
        )
        kept = await client.post(
            "/v1/completions", json=body, headers={"X-Kvgate-Priority": "critical"}
        )
    assert shed.status_code == 429
    error = openai_error(shed.content)
    assert error["code"] == "test_shed" and error["type"] == "rate_limit_error"
    assert shed.headers["retry-after"] == "3"  # whole seconds, rounded up
    assert shed.headers["retry-after-ms"] == "2400"
    assert shed.headers["x-kvgate-reason"] == "test_shed"
    assert kept.status_code == 200
    assert [p for _, _, p in policy.admitted] == [Priority.CRITICAL]
    assert not fake_engine.completions()[:-1]  # the shed request never reached the engine
    counts = gw.gateway.metrics.admissions
    assert counts["rejected", "sheddable", "test_shed"] == 1
    assert counts["admitted", "critical", "admitted"] == 1


async def test_cost_uses_max_tokens_and_tokens_are_reported(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    policy = RecordingPolicy()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    body = {"model": "fake-model", "prompt": "x" * 400, "max_tokens": 77, "stream": True,
            "fake": {"chunks": 6}}  # fmt: skip
    async with httpx.AsyncClient(base_url=gw.url) as client:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers={"x-request-id": "cost-1"}
        ) as response:
            await response.aread()
    ((rid, cost, priority),) = policy.admitted
    assert rid == "cost-1" and priority == Priority.STANDARD
    assert cost.max_output_tokens == 77 and cost.prompt_tokens > 0
    assert "cost-1" in policy.first_tokens
    assert policy.tokens["cost-1"] >= 6  # SSE data events, counted without decoding them
    assert policy.outcomes["cost-1"] is Outcome.DONE


async def test_every_ticket_is_released_exactly_once_on_every_path(
    engine_factory, gateway_factory
) -> None:
    engine = await engine_factory()
    policy = RecordingPolicy()
    gw = await gateway_factory([engine.url], policy=policy)
    base = {"model": "fake-model", "prompt": "p"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.post("/v1/completions", json={**base, "fake": {"chunks": 2}},
                          headers={"x-request-id": "done"})  # fmt: skip
        async with client.stream(
            "POST", "/v1/completions", headers={"x-request-id": "crash"},
            json={**base, "stream": True, "fake": {"chunks": 5, "crash_after": 2}},
        ) as response:  # fmt: skip
            await response.aread()
    raw = await RawClient.post(
        gw.url, "/v1/completions", {**base, "stream": True, "fake": {"interval": 5}},
        {"x-request-id": "cancel"},
    )  # fmt: skip
    await raw.read_until(b"\r\n\r\n")
    raw.drop()
    await engine.wait_closed("cancel")
    for _ in range(100):
        if "cancel" in policy.outcomes:
            break
        await asyncio.sleep(0.01)
    assert set(policy.releases.values()) == {1}
    assert len(policy.releases) == 3
    assert policy.outcomes == {
        "done": Outcome.DONE,
        "crash": Outcome.UPSTREAM_ERROR,
        "cancel": Outcome.CLIENT_CANCEL,
    }


class OneAtATime(RecordingPolicy):
    """Room for one request at a time; the next one is predicted to start within 0.5 s,
    so the flow controller lets it wait in the gateway."""

    def _decide(
        self,
        now: float,
        request: AdmissionRequest,
        expected: int,
        promised: Mapping[str, float],
    ) -> str | Reject:
        if self.in_flight_requests:
            return Reject(429, "test_busy", 1.0, "One at a time.", waitable=True)
        return super()._decide(now, request, expected, promised)

    def start_estimate(self, request: AdmissionRequest) -> StartEstimate | None:
        return StartEstimate(request.candidates[0], 0.5, 0.5) if request.candidates else None


async def _first_running(
    client: httpx.AsyncClient, policy: RecordingPolicy, delay: float
) -> asyncio.Task[httpx.Response]:
    """A request the engine answers after `delay`, admitted and holding the only room."""
    first = asyncio.create_task(
        client.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "p", "fake": {"delay": delay}},
            headers={"x-request-id": "first"},
        )
    )
    assert await eventually(lambda: len(policy.admitted) == 1, 5.0)
    return first


async def test_a_queued_request_starts_when_the_one_before_it_ends(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    policy = OneAtATime()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    admission = gw.gateway.admission
    body = {"model": "fake-model", "prompt": "p"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = await _first_running(client, policy, 0.4)
        second = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"x-request-id": "second"})
        )
        assert await eventually(lambda: admission.waiting == 1, 5.0)
        assert not any(r.request_id == "second" for r in fake_engine.completions())
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert [rid for rid, _, _ in policy.admitted] == ["first", "second"]
    assert admission.counts["queued"] == 1 and admission.counts["admitted_after_wait"] == 1
    assert admission.wait_total_s > 0
    assert 'kvgate_queue_wait_seconds_count{priority="standard"} 1.0' in metrics


async def test_a_client_that_leaves_while_queued_leaves_the_queue(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    policy = OneAtATime()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    admission = gw.gateway.admission
    body = {"model": "fake-model", "prompt": "p"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = await _first_running(client, policy, 1.0)
        raw = await RawClient.post(gw.url, "/v1/completions", body, {"x-request-id": "gone"})
        assert await eventually(lambda: admission.waiting == 1, 5.0)
        raw.drop()
        assert await eventually(lambda: admission.waiting == 0, 5.0)
        assert admission.counts["cancelled"] == 1
        assert (await first).status_code == 200  # the one running is not disturbed
    # It held nothing while it waited, and never reached the engine.
    assert [rid for rid, _, _ in policy.admitted] == ["first"]
    assert not any(r.request_id == "gone" for r in fake_engine.completions())


async def test_a_client_that_will_not_wait_is_refused_at_once(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    policy = OneAtATime()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    body = {"model": "fake-model", "prompt": "p"}
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = await _first_running(client, policy, 0.4)
        now = await client.post("/v1/completions", json=body, headers={"X-Kvgate-Max-Wait-Ms": "0"})
        bad = await client.post(
            "/v1/completions", json=body, headers={"X-Kvgate-Max-Wait-Ms": "soon"}
        )
        assert (await first).status_code == 200
    assert now.status_code == 429 and now.headers["x-kvgate-reason"] == "test_busy"
    assert now.headers["retry-after"] == "1"  # the predicted start: 0.5 s, at least 1 s
    assert bad.status_code == 400
    assert openai_error(bad.content)["param"] == "X-Kvgate-Max-Wait-Ms"
    assert gw.gateway.admission.counts["queued"] == 0


async def test_an_sdk_client_is_answered_before_its_own_timeout(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """The `openai` SDK sends its timeout (`X-Stainless-Read-Timeout`): requests queued
    behind one that runs 4 s get their 429 before the client's 3 s are up, streamed or
    not, where they would otherwise wait the queue's 60 s and the SDK would time out.
    kvgate answers by 2.7 s (a tenth of the timeout to spare): what the test needs of the
    machine is that the answer crosses the loopback within 0.3 s."""
    policy = OneAtATime()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", timeout=3.0, max_retries=0)
    loop = asyncio.get_running_loop()

    async def refused_after(stream: bool) -> tuple[float, str]:
        started = loop.time()
        with pytest.raises(openai.RateLimitError) as refused:
            await sdk.completions.create(model="fake-model", prompt="p", stream=stream)
        return loop.time() - started, refused.value.response.headers["x-kvgate-reason"]

    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client, sdk:
        first = await _first_running(client, policy, 4.0)
        answers = await asyncio.gather(refused_after(False), refused_after(True))
        assert (await first).status_code == 200
    for stream, (waited, reason) in zip((False, True), answers, strict=True):
        assert waited < 3.0, (stream, waited)
        assert reason in {"queue_timeout", "wait_exceeded"}, (stream, reason)
    assert [rid for rid, _, _ in policy.admitted] == ["first"]


async def test_a_proxys_timeout_bounds_a_streamed_answer(
    fake_engine: FakeEngine, gateway_factory
) -> None:
    """Envoy in front says the time its route gives the whole answer
    (`x-envoy-expected-rq-timeout-ms`, in ms): a stream queued behind one that runs 4 s is
    answered (429) before the route's 3 s are up, where the same stream saying nothing
    waits its turn; a malformed value is ignored, as the proxy's header is not kvgate's.
    That the whole answer, not only its start, must fit is the core's
    (`test_patience.py::test_a_proxys_timeout_bounds_a_streams_whole_answer`): here the
    header reaching it is what is checked."""
    policy = OneAtATime()
    gw = await gateway_factory([fake_engine.url], policy=policy)
    body = {"model": "fake-model", "prompt": "p", "stream": True}
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
        first = await _first_running(client, policy, 4.0)
        started = loop.time()
        cut = await client.post(
            "/v1/completions", json=body, headers={"x-envoy-expected-rq-timeout-ms": "3000"}
        )
        waited = loop.time() - started
        odd = client.post(
            "/v1/completions", json=body, headers={"x-envoy-expected-rq-timeout-ms": "soon"}
        )
        assert (await first).status_code == 200
        assert (await odd).status_code == 200  # no deadline: it waited its turn
    assert cut.status_code == 429 and waited < 3.0, (cut.status_code, waited)
    assert cut.headers["x-kvgate-reason"] in {"queue_timeout", "wait_exceeded"}
