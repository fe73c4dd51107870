"""Property: whatever bytes arrive, a parser returns a sane sample or raises
MetricsParseError, never anything else (a crash there would look like a bug, not a stale node)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.adapters import KINDS, adapter_for
from kvgate.adapters.base import MetricsParseError
from kvgate.core.signals import NodeSample

from .pages import page

_PAGES = {kind: page(kind) for kind in KINDS}
_FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(kind: str, data: bytes) -> None:
    adapter = adapter_for(kind, capacity_tokens=4096)
    for now in (0.0, 0.05):  # twice: the second parse exercises the histogram deltas
        try:
            sample = adapter.parse(data, now)
        except MetricsParseError:
            continue
        _assert_sane(sample)


def _assert_sane(sample: NodeSample) -> None:
    assert sample.running >= 0 and sample.waiting >= 0
    assert sample.kv_usage is None or 0.0 <= sample.kv_usage <= 1.0
    assert sample.kv_capacity_tokens is None or sample.kv_capacity_tokens > 0
    for value in (sample.iteration_latency_s, sample.preemptions_total):
        assert value is None or (math.isfinite(value) and value >= 0)


@_FAST
@given(kind=st.sampled_from(KINDS), data=st.binary(max_size=2048))
def test_arbitrary_bytes(kind: str, data: bytes) -> None:
    _check(kind, data)


@st.composite
def mutated_page(draw: st.DrawFn) -> tuple[str, bytes]:
    """A real page with a few random edits: byte flips, deletions, insertions of
    Prometheus-ish junk, duplicated or swapped lines."""
    kind = draw(st.sampled_from(KINDS))
    text = bytearray(_PAGES[kind])
    junk = st.sampled_from(
        [b"NaN", b"+Inf", b"-1", b"1e999", b"{", b"}", b'"', b"\n", b" ", b"\x00", b"=", b"0x1p3"]
    )
    for _ in range(draw(st.integers(1, 6))):
        if not text:
            break
        at = draw(st.integers(0, len(text) - 1))
        action = draw(st.sampled_from(["flip", "delete", "insert", "dup"]))
        if action == "flip":
            text[at] = draw(st.integers(0, 255))
        elif action == "delete":
            del text[at : at + draw(st.integers(1, 200))]
        elif action == "insert":
            text[at:at] = draw(junk)
        else:
            end = text.find(b"\n", at)
            text[at:at] = text[at : (end if end > 0 else len(text))]
    return kind, bytes(text)


@_FAST
@given(case=mutated_page())
def test_mutated_real_pages(case: tuple[str, bytes]) -> None:
    kind, data = case
    _check(kind, data)


@_FAST
@given(
    kind=st.sampled_from(KINDS),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(alphabet="0123456789.eE+-naifNAIF", max_size=12),
    ),
)
def test_any_value_on_every_wanted_line(kind: str, value: str) -> None:
    """Replace the value of every sample line with one arbitrary token."""
    lines = []
    for line in _PAGES[kind].split(b"\n"):
        if line and not line.startswith(b"#"):
            head, _, _ = line.rpartition(b" ")
            line = head + b" " + value.encode() if head else line
        lines.append(line)
    _check(kind, b"\n".join(lines))
