"""Validation of sidecar pushes (`POST /admin/signals` bodies)."""

from __future__ import annotations

import orjson
import pytest

from kvgate.adapters.push import PushValidationError, parse_push


def test_canonical_body() -> None:
    body = orjson.dumps(
        {
            "node": "gpu-a:8000",
            "kv_usage": 0.42,
            "kv_capacity_tokens": 65536,
            "running": 12,
            "waiting": 3,
            "iteration_latency_s": 0.021,
            "preemptions_total": 7,
        }
    )
    [(node, sample)] = parse_push(body, now=5.0)
    assert node == "gpu-a:8000"
    assert sample.kv_usage == 0.42 and sample.kv_capacity_tokens == 65536
    assert (sample.running, sample.waiting) == (12, 3)
    assert sample.iteration_latency_s == 0.021 and sample.preemptions_total == 7
    assert sample.sampled_at == 5.0  # our clock, never the sender's


def test_the_seed_sketch_struct_is_accepted() -> None:
    body = b'{"NodeID":"n1","KVCacheUsage":0.9,"WaitingRequests":4,"IterationLatencyMs":35,'
    body += b'"LastReportTime":"2024-01-01T00:00:00Z"}'
    [(node, sample)] = parse_push(body, now=1.0)
    assert node == "n1" and sample.kv_usage == 0.9 and sample.waiting == 4
    assert sample.iteration_latency_s == pytest.approx(0.035)


def test_a_list_of_samples() -> None:
    body = b'[{"node":"a","kv_usage":0.1},{"node":"b","kv_usage":null,"running":2}]'
    pairs = parse_push(body, now=0.0)
    assert [n for n, _ in pairs] == ["a", "b"]
    assert pairs[1][1].kv_usage is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"node":"a","kv_usage":1.01}', "kv_usage"),
        (b'{"node":"a","kv_usage":-0.5}', "kv_usage"),
        (b'{"node":"a","running":-1}', "running"),
        (b'{"node":"a","waiting":2.5}', "waiting"),
        (b'{"node":"a","waiting":true}', "waiting"),
        (b'{"node":"a","kv_capacity_tokens":0}', "kv_capacity_tokens"),
        (b'{"node":"a","iteration_latency_s":-1}', "iteration_latency_s"),
        (b'{"node":"","kv_usage":0.1}', "node"),
        (b'{"node":"has space"}', "node"),
        (b'{"kv_usage":0.1}', "node"),
        (b'{"node":"a","surprise":1}', "surprise"),
        (b'{"node":"a","iteration_latency_s":0.1,"iteration_latency_ms":100}', None),
        (b'[{"node":"a"},{"node":"b","running":-3}]', "[1].running"),
    ],
)
def test_invalid_fields_name_the_param(body: bytes, param: str | None) -> None:
    with pytest.raises(PushValidationError) as info:
        parse_push(body, now=0.0)
    assert info.value.param == param
    assert info.value.message


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b'{"node":"a","kv_usage":NaN}', b"[]", b"[1]", b'"a"', b"1e999", b"{"],
)
def test_malformed_bodies(body: bytes) -> None:
    with pytest.raises(PushValidationError):
        parse_push(body, now=0.0)


def test_oversized_body() -> None:
    with pytest.raises(PushValidationError, match="larger"):
        parse_push(b" " * (1024 * 1024 + 1), now=0.0)
