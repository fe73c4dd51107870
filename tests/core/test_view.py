"""A replica's view and its JSON form: what is published reads back the same, and a view
with missing or ill-typed fields reads as whatever of it can be read."""

from __future__ import annotations

import orjson
import pytest

from kvgate.core.replicas.view import PeerHold, PeerView, QueueDemand, TenantDemand

VIEW = PeerView(
    replica="gw-1",
    nodes={"a": (PeerHold(16.0, 316.0, 84.0, 1.25),), "b": ()},
    claims={"a": 1200.5},
    prefixes={"a": (-8_000_000_000_000_000_000, 42)},
    queue=QueueDemand(4000, 900, 2.5, 120.0),
    tenants={"acme": (2000, 3)},
    tenant_queue={"acme": TenantDemand(2.0, 1500.0, 700.0, 2.5)},
    tenant_claims={"acme": (300.0, None)},
    service={"acme": 5000.0},
)


def test_the_json_form_reads_back_the_same_view() -> None:
    wire = orjson.loads(orjson.dumps(VIEW.to_json()))
    assert PeerView.from_json(wire) == VIEW
    assert "view_age_s" not in wire  # a publisher does not know its view's age
    assert wire["nodes"]["a"] == [[16.0, 316.0, 84.0, 1.25]]
    assert wire["queue"] == {
        "waiting_tokens": 4000,
        "head_tokens": 900,
        "head_age_s": 2.5,
        "arrival_tokens_per_s": 120.0,
    }
    assert wire["tenant_claims"] == {"acme": [300.0, None]}
    assert wire["prefixes"] == {"a": [-8_000_000_000_000_000_000, 42]}  # 64-bit hashes


def test_the_receiver_sets_the_age() -> None:
    aged = PeerView.from_json({**VIEW.to_json(), "view_age_s": 0.04})
    assert aged.age_s == 0.04 and aged.to_json()["view_age_s"] == 0.04


@pytest.mark.parametrize(
    "data",
    [None, [], "view", {"replica": 7}, {"nodes": "x", "claims": [1], "queue": 3, "service": None}],
)
def test_a_view_that_is_not_one_reads_as_empty(data: object) -> None:
    view = PeerView.from_json(data)
    assert not view.nodes and not view.claims and not view.tenants and not view.service
    assert view.queue == QueueDemand() and view.age_s == 0.0


def test_malformed_entries_are_skipped_and_the_rest_is_kept() -> None:
    view = PeerView.from_json(
        {
            "replica": "gw-2",
            "nodes": {"a": [[1, 2, 3, 4], [1, "x", 3, 4], [1, 2, 3], "?", [True, 2, 3, 4]]},
            "claims": {"a": 10, "b": "lots"},
            "queue": {"waiting_tokens": 5, "head_tokens": "big"},
            "tenants": {"t": [1, 2], "u": [1]},
            "tenant_queue": {"t": [1, 2, 3, 4], "u": None},
            "tenant_claims": {"t": [None, 2], "u": ["x", 1]},
            "service": {"t": 1.5, "u": {}},
            "prefixes": {"a": [1, "2", 3.5, True, 4], "b": 5},
            "view_age_s": "old",
        }
    )
    assert view.nodes == {"a": (PeerHold(1.0, 2.0, 3.0, 4.0),)}
    assert view.claims == {"a": 10.0} and view.service == {"t": 1.5}
    assert view.queue == QueueDemand(5.0, 0.0, 0.0, 0.0)
    assert view.tenants == {"t": (1, 2)} and view.tenant_queue == {"t": TenantDemand(1, 2, 3, 4)}
    assert view.tenant_claims == {"t": (None, 2.0)} and view.age_s == 0.0
    assert view.prefixes == {"a": (1, 4)}
