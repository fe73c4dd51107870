"""What every engine adapter shares: the error type, a targeted Prometheus line scanner,
value checks, the histogram-delta tracker and the adapter interface.

Why a targeted scanner instead of `prometheus_client.parser`: an engine's page is mostly
histogram buckets nobody here reads (a vLLM page is ~53 KB, 617 lines). Parsing it all
costs ~14 ms of CPU per scrape; finding only the lines of the few metrics a dialect needs
with `bytes.find` costs ~0.08 ms (numbers: `benchmarks/scrape_cost/results.md`). At 50 ms
per node that is the difference between ~3 nodes per core and hundreds.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import aiohttp

from kvgate.core.signals import NodeSample

log = logging.getLogger(__name__)

_LABEL_RE = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"')

#: Largest page the scraper reads and the parser accepts; real pages are 5-100 KB.
MAX_PAGE_BYTES = 8 * 1024 * 1024


class MetricsParseError(ValueError):
    """A metrics page that cannot be turned into a sample: garbage, truncated, missing a
    required metric, or carrying an impossible value (NaN, negative count, usage > 1)."""


@dataclass(frozen=True, slots=True)
class Series:
    """One exposition line of a wanted metric: its raw label text and its value."""

    labels_raw: bytes
    value: float

    def labels(self) -> dict[str, str]:
        """Decode the labels only when an adapter needs them (most do not)."""
        return {
            k.decode("utf-8", "replace"): _unescape(v)
            for k, v in _LABEL_RE.findall(self.labels_raw)
        }

    def label(self, name: str) -> str | None:
        """One label's value, found without decoding the others (vLLM's info gauge carries
        ~40 labels; decoding them all three times per scrape was half the parse cost)."""
        match = _label_pattern(name).search(self.labels_raw)
        return None if match is None else _unescape(match.group(1))


@functools.cache
def _label_pattern(name: str) -> re.Pattern[bytes]:
    escaped = re.escape(name.encode())
    return re.compile(rb"(?:^|[,{\s])" + escaped + rb'\s*=\s*"((?:[^"\\\n]|\\.)*)"')


_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def _unescape(raw: bytes) -> str:
    """Label value escapes of the text format: `\\\\`, `\\"` and `\\n`, in one pass."""
    text = raw.decode("utf-8", "replace")
    if "\\" not in text:
        return text
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


class MetricScanner:
    """Finds the lines of a few named metrics in a Prometheus text page, skipping the rest.

    For each wanted name it searches `\\n<name>` with `bytes.find` (C speed, no Python
    work per skipped line), then parses only the hits. A hit that is not a well-formed
    sample line is an error, so corruption of a line we need is never skipped. Names are
    searched lazily, on first use, so a fallback name (an older engine's spelling) costs
    nothing when the current one is present.
    """

    def __init__(self, names: Iterable[str]) -> None:
        wanted = sorted(set(names))
        if not wanted:
            raise ValueError("a scanner needs at least one metric name")
        self._needles = {n: b"\n" + n.encode() for n in wanted}

    @property
    def names(self) -> tuple[str, ...]:
        """The metric (sample) names this scanner looks for, sorted."""
        return tuple(self._needles)

    def scan(self, page: bytes) -> ScannedPage:
        """A lazy view of `page`: `view[name]` / `view.get(name)` give that metric's lines."""
        if not isinstance(page, bytes | bytearray | memoryview):
            raise MetricsParseError(f"a metrics page must be bytes, not {type(page).__name__}")
        if len(page) > MAX_PAGE_BYTES:
            raise MetricsParseError(f"metrics page too large ({len(page)} bytes)")
        return ScannedPage(b"\n" + bytes(page), self._needles)  # "\n": find line 1 too


class ScannedPage(Mapping[str, list[Series]]):
    """The wanted metrics of one page, each searched for on first access and remembered.

    Absent metrics raise KeyError (so `.get()` returns None); asking for a name the
    scanner was not built for is a programming error (ValueError).
    """

    __slots__ = ("_cache", "_needles", "_page")

    def __init__(self, page: bytes, needles: Mapping[str, bytes]) -> None:
        self._page = page
        self._needles = needles
        self._cache: dict[str, list[Series]] = {}

    def __getitem__(self, name: str) -> list[Series]:
        found = self._cache.get(name)
        if found is None:
            found = self._cache[name] = self._find(name)
        if not found:
            raise KeyError(name)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter([n for n in self._needles if self.get(n)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _find(self, name: str) -> list[Series]:
        needle = self._needles.get(name)
        if needle is None:
            raise ValueError(f"{name!r} is not one of this scanner's metrics")
        out: list[Series] = []
        page, start, size = self._page, 0, len(needle) - 1
        end = len(page)
        while (hit := page.find(needle, start, end)) >= 0:
            begin = hit + 1
            start = begin + size
            if start < end and page[start] not in _AFTER_NAME:
                continue  # a longer name that merely starts with ours
            if not out:
                # The exposition format keeps a metric's lines in one group, ended by the
                # next family's comment: later lines are searched for only up to there,
                # which spares a scan of the rest of the page for every name.
                comment = page.find(b"\n#", start)
                end = len(page) if comment < 0 else comment
            stop = page.find(b"\n", start, end)
            out.append(_parse_line(page[begin : end if stop < 0 else stop], size, name))
        return out


_AFTER_NAME = frozenset(b"{ \t")


def _parse_line(line: bytes, name_len: int, name: str) -> Series:
    rest = line[name_len:]
    labels = b""
    if rest[:1] == b"{":
        close = rest.rfind(b"}")
        if close < 0:
            raise MetricsParseError(f"{name}: unterminated label set in {line[:80]!r}")
        labels = rest[1:close]
        rest = rest[close + 1 :]
    fields = rest.split()
    if not fields or len(fields) > 2:
        raise MetricsParseError(f"{name}: malformed sample line {line[:80]!r}")
    return Series(labels, _number(fields[0], name))


def _number(raw: bytes, name: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise MetricsParseError(f"{name}: value {raw[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise MetricsParseError(f"{name}: value {raw[:40]!r} is not finite")
    return value


# ---- helpers for adapters -------------------------------------------------------------


def require(found: Mapping[str, list[Series]], *names: str) -> tuple[str, list[Series]]:
    """The first of `names` present on the page (newest name first); error when none is."""
    for name in names:
        series = found.get(name)
        if series:
            return name, series
    raise MetricsParseError(f"required metric missing: {' or '.join(names)}")


def optional(found: Mapping[str, list[Series]], *names: str) -> list[Series]:
    for name in names:
        series = found.get(name)
        if series:
            return series
    return []


def total(series: Iterable[Series]) -> float:
    return math.fsum(s.value for s in series)


def count(value: float, name: str) -> int:
    """A gauge that counts requests: non-negative and (after float formatting) integral."""
    if value < 0:
        raise MetricsParseError(f"{name}: negative count {value}")
    if value > 1e12:
        raise MetricsParseError(f"{name}: implausible count {value}")
    return round(value)


def fraction(value: float, name: str) -> float:
    """A 0-1 usage. Tiny float noise above 1 is clamped; anything else out of range is an error."""
    if value < 0 or value > 1.0 + 1e-6:
        raise MetricsParseError(f"{name}: usage {value} outside [0, 1]")
    return min(value, 1.0)


def non_negative(value: float, name: str) -> float:
    if value < 0:
        raise MetricsParseError(f"{name}: negative value {value}")
    return value


def positive_int_label(series: Series, label: str, name: str) -> int | None:
    """An integer carried in a label (vLLM's cache_config_info); None when absent or 'None'."""
    raw = series.label(label)
    if raw is None or raw in ("", "None", "null"):
        return None
    try:
        value = int(float(raw))
    except ValueError:
        raise MetricsParseError(f"{name}: label {label}={raw[:40]!r} is not a number") from None
    if value <= 0:
        raise MetricsParseError(f"{name}: label {label}={value} must be positive")
    return value


def capacity_weighted_usage(parts: list[tuple[float, int | None]]) -> float:
    """Combine the KV usages of several engines behind one node (data parallelism).

    Weighted by capacity when every part's capacity is known, so one full engine and one
    empty one of equal size read 0.5 and a small full engine does not dominate; a plain
    mean otherwise.
    """
    if all(cap is not None for _, cap in parts):
        cap_total = sum(cap for _, cap in parts if cap is not None)
        if cap_total > 0:
            return min(1.0, sum(u * cap for u, cap in parts if cap is not None) / cap_total)
    return min(1.0, sum(u for u, _ in parts) / len(parts))


class HistogramDelta:
    """Mean of a histogram between two scrapes: (sum_now - sum_prev) / (count_now - count_prev).

    Stateful per node. On the first scrape, and after the counters went backwards (engine
    restart: it starts over), the mean of everything the histogram holds: an engine that
    has run before says how fast it steps before the gateway sees it step. None when no
    observation was made in between (or ever). `observed`: how many observations the last
    mean rests on (None with it), the weight a sample's mean gets (`NodeSample
    .iteration_tokens`).
    """

    __slots__ = ("_count", "_sum", "observed")

    def __init__(self) -> None:
        self._sum: float | None = None
        self._count: float | None = None
        self.observed: float | None = None

    def update(self, hist_sum: float, hist_count: float) -> float | None:
        prev_sum, prev_count = self._sum, self._count
        self._sum, self._count = hist_sum, hist_count
        d_count, d_sum = hist_count, hist_sum
        if prev_sum is not None and prev_count is not None:
            if hist_count >= prev_count and hist_sum >= prev_sum:
                d_count, d_sum = hist_count - prev_count, hist_sum - prev_sum
        if d_count <= 0 or d_sum < 0:
            self.observed = None
            return None
        self.observed = d_count
        return d_sum / d_count

    def reset(self) -> None:
        self._sum = self._count = self.observed = None


# ---- the interface ---------------------------------------------------------------------


@runtime_checkable
class EngineAdapter(Protocol):
    """Turns one engine dialect's metrics page into a `NodeSample`, and aborts requests.

    One instance per node: it keeps the previous histogram totals for latency deltas and
    remembers whether the node's abort API works.
    """

    kind: str
    #: A body field the engine takes as the request's id, for engines whose abort API can
    #: only name a request by an id the request itself carried (SGLang's `rid`); None when
    #: the engine learns the id from the `X-Request-Id` header or needs none.
    request_id_field: str | None

    def parse(self, page: bytes, now: float) -> NodeSample:
        """Raise `MetricsParseError` (and nothing else) on any unusable page."""
        ...

    async def abort(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        request_id: str,
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        """Ask the engine to drop `request_id` now. True when the engine confirmed it; False
        when the engine has no abort API (then closing the connection is the abort), the
        API is disabled, or the call failed. Never raises except on cancellation."""
        ...


@runtime_checkable
class NarrowablePage(Protocol):
    """An adapter whose engine can serve a page of just the metrics the adapter reads.

    prometheus_client's exposition apps answer `?name[]=a&name[]=b` with only those
    samples. vLLM's page is ~50 KB and rendering it costs its API server ~10 ms, the same
    process that streams tokens: scraped every 50 ms that is ~20 % of a core (measured on
    the real CPU engine). The narrowed page is ~2 KB and ~2 ms. The scraper checks once per
    node that the narrowed page carries every metric the full one does before it uses it
    (`Scraper`), since an engine may ignore the filter or (in multi-process mode) answer
    it with nothing.
    """

    def narrowed_metrics_url(self, metrics_url: str) -> str | None:
        """The URL of the narrowed page for this full page URL; None to keep the full one."""
        ...

    def metrics_on(self, page: bytes) -> frozenset[str]:
        """Which of the metrics this adapter reads are on `page` (parse errors propagate)."""
        ...


class NoAbortAPI:
    """Mixin for engines whose only abort is closing the upstream connection."""

    abort_supported: bool = False
    request_id_field: str | None = None

    async def abort(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        request_id: str,
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> bool:
        return False


class AbortAPI:
    """Mixin for engines with an HTTP abort endpoint that may be disabled on the server.

    The first refusal (403/404/405) is remembered, so a node without the API costs one
    call, not one per cancelled request; closing the connection stays the abort there.
    """

    abort_supported: bool = True
    request_id_field: str | None = None

    async def _post_abort(
        self,
        session: aiohttp.ClientSession,
        url: str,
        payload: Mapping[str, object],
        headers: Mapping[str, str] | None,
    ) -> bool:
        if not self.abort_supported:
            return False
        try:
            async with session.post(url, json=payload, headers=dict(headers or {})) as resp:
                await resp.read()
                if resp.status in (403, 404, 405):
                    self.abort_supported = False
                    log.info(
                        "%s has no abort API (HTTP %d); relying on disconnect", url, resp.status
                    )
                    return False
                return 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.debug("abort %s at %s failed: %r", payload, url, exc)
            return False


def grouped(series: Iterable[Series], label: str) -> dict[str, list[Series]]:
    """Split series by one label's value ("" when absent): one group per engine/DP rank."""
    out: dict[str, list[Series]] = {}
    for s in series:
        out.setdefault(s.label(label) or "", []).append(s)
    return out


def with_label(series: Iterable[Series], label: str, value: str) -> list[Series]:
    """The series whose `label` equals `value` (Triton packs several gauges in one family)."""
    return [s for s in series if s.label(label) == value]
