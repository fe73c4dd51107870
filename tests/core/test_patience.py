"""Clients' deadlines, said or learned from the ones that left (`kvgate.core.flow.patience`),
and the flow controller's bound that follows from them, in virtual time."""

from __future__ import annotations

import random

from kvgate.core.admission import Outcome, Reject, Ticket
from kvgate.core.flow import Waiter
from kvgate.core.flow.patience import HALF_LIFE_S, MIN_LEFT, Patience
from kvgate.core.request import AdmissionRequest, RequestCost
from tests.core.flowkit import Bench


def _ticket(tenant: str, arrived: float, started: float, first: float | None) -> Ticket:
    request = AdmissionRequest("r", RequestCost(100, 100), tenant=tenant)
    return Ticket(request, "a", started, waited_s=started - arrived, first_token_at=first)


def test_a_timeout_shows_as_a_cliff_at_its_value() -> None:
    patience, rng = Patience(), random.Random(1)
    for _ in range(60):
        patience.answered("t", rng.uniform(0.05, 9.0), 100.0)
    for _ in range(12):
        patience.left("t", 10.0, 100.0)
    learned = patience.deadline("t", 100.0)
    assert learned is not None and 9.4 <= learned <= 10.0
    assert patience.deadline("other", 100.0) is None  # per tenant


def test_nothing_is_learned_while_few_leave() -> None:
    patience = Patience()
    for _ in range(int(MIN_LEFT) - 1):
        patience.left("t", 3.0, 100.0)
    assert patience.deadline("t", 100.0) is None
    assert (
        patience.bound(AdmissionRequest("r", RequestCost(1, 100), tenant="t"), 100, 100.0) is None
    )


def test_clients_that_waited_longer_keep_the_estimate_up() -> None:
    """Half the clients leave at 2 s, the other half get answers after 5 s: the ones that
    left are fewer than half of those still waiting at 2 s, so patience is not 2 s."""
    patience = Patience()
    for _ in range(10):
        patience.left("t", 2.0, 100.0)
    for _ in range(30):
        patience.answered("t", 5.0, 100.0)
    assert patience.deadline("t", 100.0) is None


def test_clients_that_leave_at_random_moments_show_no_deadline() -> None:
    """People who give up at any moment, or stop answers once they have read enough:
    the curve falls gradually, and nothing is bounded."""
    rng = random.Random(2)
    patience = Patience()
    for _ in range(200):
        patience.left("t", rng.uniform(0.1, 20.0), 100.0)
    assert patience.deadline("t", 100.0) is None
    for i in range(100):  # each stopped its answer at a random moment after it began
        stopped = _ticket("u", 0.0, 0.2, 0.5)
        patience.ended(stopped, Outcome.CLIENT_CANCEL, rng.expovariate(1 / 4.0))
        if i % 2:
            patience.ended(_ticket("u", 0.0, 0.2, 0.5), Outcome.DONE, rng.uniform(0.5, 6.0))
    assert patience.deadline("u", 100.0) is None


def test_a_timeout_mid_answer_is_a_deadline_too() -> None:
    """A slow engine: clients time out after 10 s in the middle of their answers."""
    patience, rng = Patience(), random.Random(3)
    for _ in range(30):
        patience.ended(_ticket("t", 0.0, 1.0, 2.0), Outcome.DONE, rng.uniform(3.0, 9.5))
    for _ in range(30):
        patience.ended(_ticket("t", 0.0, 1.0, 2.0), Outcome.CLIENT_CANCEL, 10.0)
    learned = patience.deadline("t", 10.0)
    assert learned is not None and 9.4 <= learned <= 10.0


def test_the_bound_leaves_time_for_the_answer_and_the_estimate_decays() -> None:
    patience = Patience()
    done = _ticket("t", 0.0, 1.0, 1.1)
    done.output_tokens = 100
    patience.ended(done, Outcome.DONE, 3.0)  # 2 s for 100 tokens: 20 ms per token
    for _ in range(2 * int(MIN_LEFT)):  # answered before the deadline: they stay until it
        patience.answered("t", 4.0, 5.0)
    for _ in range(10):
        patience.left("t", 10.0, 5.0)
    bound = patience.bound(AdmissionRequest("r", RequestCost(1, 200), tenant="t"), 200, 5.0)
    learned = patience.deadline("t", 5.0)
    assert learned is not None and bound is not None
    assert abs(bound - (learned - 200 * 0.02)) < 1e-9
    # Nobody leaves any more (the bound holds): the evidence decays below MIN_LEFT.
    assert patience.deadline("t", 5.0 + HALF_LIFE_S) is not None
    assert patience.deadline("t", 5.0 + 2 * HALF_LIFE_S) is None


def _answer_some(bench: Bench) -> None:
    """Six of the tenant's requests answered within half a second: its clients stay that
    long at least."""
    for _ in range(6):
        bench.submit(100, 50, tenant="t")
    bench.run_until_idle()


def test_clients_that_cancel_before_any_answer_show_no_deadline() -> None:
    """Requests cancelled at once, none answered yet (a test, a client that changes its
    mind): a cliff with nobody seen to stay before it is no deadline."""
    patience = Patience()
    for _ in range(8):
        patience.left("t", 0.15, 100.0)
    for _ in range(8):
        patience.answered("t", 6.0, 100.0)  # answered long after: at risk at 0.15 s
    assert patience.deadline("t", 100.0) is None
    fresh = Patience()
    for _ in range(8):
        fresh.left("t", 0.15, 100.0)
    assert fresh.deadline("t", 100.0) is None


def test_a_request_that_would_wait_past_its_clients_deadline_is_refused_at_once() -> None:
    """Clients left the queue after 2 s: an arrival that cannot start for about 10 s gets
    its 429 (with the plan that kept it out and a Retry-After) now, not once its client
    has gone; another tenant's, whose clients wait, still queues."""
    bench = Bench()
    _answer_some(bench)
    for _ in range(3):  # each runs 10 s (1,000 steps of 10 ms)
        bench.submit(500, 500, tenant="t")
    waiters = [bench.submit(500, 500, tenant="t", name=f"w{i}") for i in range(8)]
    bench.step(200)  # 2 s
    for waiter in waiters:
        assert isinstance(waiter, Waiter)
        bench.flow.cancel(waiter)
    learned = bench.flow.patience.deadline("t", bench.clock.now())
    assert learned is not None and learned <= 2.0
    late = bench.submit(500, 500, tenant="t", name="late")
    assert isinstance(late, Reject) and late.status == 429, late
    assert late.reason == "kv_planned_peak" and late.retry_after_s > 0
    # Another tenant's clients showed no impatience: its request waits.
    assert isinstance(bench.submit(500, 500, tenant="u", name="patient"), Waiter)
    snapshot = bench.flow.queue_snapshot()["patience"]["tenants"]
    assert snapshot["t"]["deadline_s"] == learned


def test_an_answer_that_would_end_after_the_deadline_does_not_start() -> None:
    """Clients leave after 2 s: on an idle node, a request whose 500 tokens take 5 s at the
    node's 10 ms step gets a 429 `client_deadline` and holds nothing; one of 100 starts."""
    bench = Bench()
    _answer_some(bench)
    for _ in range(3):
        bench.submit(500, 500, tenant="t")
    waiters = [bench.submit(500, 500, tenant="t") for _ in range(8)]
    bench.step(200)
    for waiter in waiters:
        assert isinstance(waiter, Waiter)
        bench.flow.cancel(waiter)
    bench.run_until_idle()
    long = bench.submit(500, 500, tenant="t", name="long")
    assert isinstance(long, Reject) and long.reason == "client_deadline", long
    assert "leave after" in long.message and long.retry_after_s > 0
    assert bench.books_empty()
    bench.submit(500, 100, tenant="t", name="short")
    assert bench.admitted("short")
    bench.submit(500, 500, tenant="u", name="other")  # no deadline for this tenant: it starts
    assert bench.admitted("other")


def test_a_clients_own_timeout_bounds_its_wait_from_the_first_request() -> None:
    """A fresh gateway, nothing learned: a request whose client says it gives up after
    2 s (the OpenAI SDKs' header), behind 10 s of work, gets its 429 at once; the same
    request saying nothing, or 60 s, waits."""
    bench = Bench()
    for _ in range(3):  # each runs 10 s (1,000 steps of 10 ms)
        bench.submit(500, 500)
    hasty = bench.submit(500, 500, name="hasty", timeout_s=2.0)
    assert isinstance(hasty, Reject) and hasty.status == 429, hasty
    assert hasty.retry_after_s > 2.0
    assert isinstance(bench.submit(500, 500, name="silent"), Waiter)
    assert isinstance(bench.submit(500, 500, name="patient", timeout_s=60.0), Waiter)


def test_a_stream_must_only_start_within_its_timeout() -> None:
    """On an idle node, an answer of 500 tokens takes 5 s: a client that gives up on an
    answer not ended within 2 s is refused `client_deadline`; a stream with the same
    timeout starts (its first bytes come at once, and keep it alive)."""
    bench = Bench()
    whole = bench.submit(500, 500, name="whole", timeout_s=2.0)
    assert isinstance(whole, Reject) and whole.reason == "client_deadline", whole
    assert "timeout of 2.0 s" in whole.message
    assert bench.books_empty()
    bench.submit(500, 500, name="stream", timeout_s=2.0, stream=True)
    assert bench.admitted("stream")


def test_a_proxys_timeout_bounds_a_streams_whole_answer() -> None:
    """A proxy in front (Envoy's route timeout) gives the whole answer 2 s, streamed or
    not: on an idle node the 5 s answer does not start; the same stream with a read timeout
    of 2 s and a proxy's 8 s starts, and the shorter of two said timeouts decides."""
    bench = Bench()
    cut = bench.submit(500, 500, name="cut", answer_timeout_s=2.0, stream=True)
    assert isinstance(cut, Reject) and cut.reason == "client_deadline", cut
    assert "timeout of 2.0 s" in cut.message
    both = bench.submit(500, 500, name="both", timeout_s=2.0, answer_timeout_s=30.0)
    assert isinstance(both, Reject) and "timeout of 2.0 s" in both.message, both
    assert bench.books_empty()
    bench.submit(500, 500, name="roomy", timeout_s=2.0, answer_timeout_s=8.0, stream=True)
    assert bench.admitted("roomy")


def test_a_queued_stream_waits_within_its_timeout_only() -> None:
    """Behind 10 s of work, a stream whose client gives up after 3 s is answered (429) a
    second before it would leave, never after; one that waits 12 s starts once there is
    room, though its answer runs 5 s more."""
    bench = Bench()
    for _ in range(3):  # each runs 10 s
        bench.submit(500, 500)
    start = bench.clock.now()
    bench.submit(500, 500, name="hasty", timeout_s=3.0, stream=True)
    bench.submit(500, 500, name="patient", timeout_s=12.0, stream=True)
    refused_at = None
    while not bench.admitted("patient") and bench.clock.now() - start < 12.0:
        if refused_at is None and isinstance(bench.decisions.get("hasty"), Reject):
            refused_at = bench.clock.now() - start
        bench.step(1)
    hasty = bench.decisions["hasty"]
    assert isinstance(hasty, Reject) and hasty.status == 429, hasty
    assert refused_at is not None and refused_at <= 2.0 + 1e-9
    assert bench.admitted("patient") and bench.clock.now() - start <= 11.0
