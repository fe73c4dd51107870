"""Shared samples: records survive the trip, garbage is refused, feeding adds only news."""

from __future__ import annotations

from kvgate.cluster.samples import PUBLISH_FOR_S, ClockLink, Record, SampleLedger, SharingSink
from kvgate.core.clock import ManualClock
from kvgate.core.signals import NodeSample

from .conftest import RecordingSink


def sample(at: float, usage: float = 0.5) -> NodeSample:
    return NodeSample(usage, 4096, 3, 1, 0.02, at, 7.0)


def link_at(offset: float) -> ClockLink:
    link = ClockLink()
    link.observe(0.0, 0.0, offset)  # exact: no round trip
    return link


def test_a_record_round_trips_through_json() -> None:
    record = Record(12.5, 2, sample(12.0))
    assert Record.from_json(record.to_json()) == record
    assert Record.from_json(Record(3.0, 0, None).to_json()) == Record(3.0, 0, None)


def test_garbage_records_are_refused() -> None:
    for bad in (None, 3, "x", {}, {"at": "nan", "fails": 0, "sample": None},
                {"at": 1.0, "fails": -1, "sample": None},
                {"at": 1.0, "fails": 0, "sample": {"kv_usage": 0.1}}):  # fmt: skip
        assert Record.from_json(bad) is None


def test_the_sharing_sink_feeds_the_policy_and_publishes_in_store_time() -> None:
    clock = ManualClock(50.0)
    ledger = SampleLedger()
    policy = RecordingSink()
    sink = SharingSink(policy, ledger, clock)
    sink.observe("n1", sample(49.9))
    clock.advance(0.05)
    sink.observe_failure("n1")
    assert policy.samples == [("n1", sample(49.9))] and policy.failures == ["n1"]
    records = ledger.records(clock.now(), link_at(1000.0))  # store = local + 1000
    assert records["n1"]["at"] == 1050.05
    assert records["n1"]["fails"] == 1
    assert records["n1"]["sample"]["sampled_at"] == 1049.9
    clock.advance(PUBLISH_FOR_S + 0.01)
    assert ledger.records(clock.now(), link_at(1000.0)) == {}  # no longer polled here


def test_feeding_passes_only_what_is_new() -> None:
    ledger = SampleLedger()
    policy = RecordingSink()
    link = link_at(-100.0)  # local = store + 100
    ledger.feed("n1", Record(10.0, 0, sample(9.9)), link, policy)
    ledger.feed("n1", Record(10.05, 0, sample(9.9)), link, policy)  # same sample again
    assert [s.sampled_at for _, s in policy.samples] == [109.9]
    ledger.feed("n1", Record(10.10, 2, sample(9.9)), link, policy)
    ledger.feed("n1", Record(10.15, 3, sample(9.9)), link, policy)
    assert policy.failures == ["n1"] * 3  # 2, then one more
    ledger.feed("n1", Record(10.2, 0, sample(10.2, 0.7)), link, policy)
    assert policy.last("n1") == sample(110.2, 0.7)
    ledger.feed("n1", Record(10.25, 0, sample(10.0)), link, policy)  # older: nothing
    assert len(policy.samples) == 2


def test_forgotten_engines_are_neither_published_nor_remembered() -> None:
    ledger = SampleLedger()
    ledger.record_sample("gone", sample(1.0), 1.0)
    ledger.record_sample("kept", sample(1.0), 1.0)
    ledger.keep_only({"kept"})
    assert set(ledger.records(1.0, link_at(0.0))) == {"kept"}


def test_polls_abandoned_unanswered_are_fed_as_soft_failures() -> None:
    ledger = SampleLedger()
    policy = RecordingSink()
    link = link_at(0.0)
    ledger.feed("n1", Record(10.0, 1, sample(9.9), soft_failures=2), link, policy)
    assert policy.failures == ["n1", "n1 (soft)", "n1 (soft)"]
    assert Record.from_json(Record(1.0, 0, None, 3).to_json()) == Record(1.0, 0, None, 3)
