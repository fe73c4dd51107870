"""A run: what configures a virtual one, and what a run records, virtual or live.

`VirtualConfig` is everything a virtual-time run (`kvgate.sim.virtual`) is a pure function
of. `ClientModel` says how a client waits, gives up and retries (the simulator's clients
and the live benchmark's, `kvgate.bench.live`, follow the same one). Every try is an
`Attempt` whose `outcome` is one of `OUTCOMES`; a virtual run gives one `RequestOutcome`
per client request (its tries, its status), one `SeriesPoint` per `series_interval_s`
(`series_point`), and its `VirtualResult`; `scrape` is what a replica reads of an engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvgate.core.policies.baselines import BaselineOptions, PolicyName
from kvgate.core.settings import AdmissionSettings, QueueSettings
from kvgate.core.signals import NodeSample
from kvgate.sim.kv_fanout import KVEventsVia
from kvgate.sim.model.engine import Engine, EngineConfig
from kvgate.sim.workload import WorkloadSpec

# How one try ended, from the client's point of view (shared with the live benchmark).
OK = "ok"  # the whole answer arrived within the client's timeout
TIMEOUT = "timeout"  # the client gave up waiting and disconnected
SHED = "shed"  # 429 from the gateway: never reached an engine
UNAVAILABLE = "unavailable"  # 503 (no backend could serve at all)
ERROR = "error"  # any other 5xx or transport error
OUTCOMES = (OK, TIMEOUT, SHED, UNAVAILABLE, ERROR)


class _Uniform(Protocol):
    def uniform(self, a: float, b: float, /) -> Any: ...


RetryMode = Literal["immediate", "backoff"]


@dataclass(frozen=True, slots=True)
class ClientModel:
    """How clients wait, give up and retry: one model for virtual and live runs.

    `deadline="answer"` is a whole-answer deadline (an HTTP client's total timeout);
    `"token"` restarts the clock at each streamed token (a read timeout). After a timeout
    or a 5xx the client retries at once (`retry="immediate"`) or after an exponential
    backoff with full jitter (`"backoff"`); a 429 waits for its Retry-After when
    `honor_retry_after`. It gives up after `max_attempts` tries of any kind, after
    `max_retries` retries of timeouts/5xx, or after `max_429_tries` 429s (None: no
    separate bound). `says_timeout`: each try carries its timeout, a read timeout as the
    OpenAI SDKs send theirs (`AdmissionRequest.timeout_s`), a whole-answer one as a proxy's
    route timeout (Envoy's; `AdmissionRequest.answer_timeout_s`).
    """

    timeout_s: float = 30.0
    deadline: Literal["answer", "token"] = "answer"
    max_attempts: int = 4
    max_retries: int | None = None
    max_429_tries: int | None = None
    retry: RetryMode = "immediate"
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    honor_retry_after: bool = True
    says_timeout: bool = False

    def retry_delay(self, attempt_no: int, rng: _Uniform) -> float:
        """Delay before try `attempt_no + 1` after a timeout or 5xx on try `attempt_no`."""
        if self.retry == "immediate":
            return 0.0
        cap = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt_no - 1))
        return float(rng.uniform(0.0, cap))


def read_timeout_client(timeout_s: float, max_retries: int = 2) -> ClientModel:
    """A streaming client with a per-token read timeout, `max_retries` backed-off retries
    (1 s doubling up to 30 s) and up to five 429s: the simulator's capacity-study client."""
    return ClientModel(
        timeout_s=timeout_s,
        deadline="token",
        max_attempts=1 + max_retries + 5,
        max_retries=max_retries,
        max_429_tries=5,
        retry="backoff",
        backoff_base_s=1.0,
        backoff_max_s=30.0,
    )


@dataclass(slots=True)
class Attempt:
    """One try (an HTTP request, or its virtual twin). Times are seconds on the run's clock."""

    start: float
    end: float
    outcome: str
    first_token_at: float | None = None
    output_tokens: int = 0
    retry_after_s: float | None = None
    node: str | None = None
    waited_s: float = 0.0  # in the gateway's queue before it was admitted
    replica: int | None = None  # the gateway replica that admitted it (virtual runs)

    @property
    def admitted(self) -> bool:
        """Did this attempt reach an engine (i.e. was not refused by the gateway)?"""
        return self.outcome not in (SHED, UNAVAILABLE)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_at is None or self.output_tokens < 2 or self.outcome != OK:
            return None
        return (self.end - self.first_token_at) / (self.output_tokens - 1)


# A gateway without a queue: every request is admitted or refused at once.
NO_QUEUE = QueueSettings(max_wait_s={"critical": 0, "standard": 0, "sheddable": 0})


@dataclass(frozen=True, slots=True)
class VirtualConfig:
    engine: EngineConfig
    workload: WorkloadSpec
    duration_s: float
    nodes: int = 16
    gateways: int = 1
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # The placement every replica runs, by name (`kvgate.core.policies.baselines`), and the
    # static baselines' quotas.
    policy: PolicyName = "none"
    baseline: BaselineOptions = field(default_factory=BaselineOptions)
    # The gateway's queue (`NO_QUEUE`: every request is decided at once).
    queue: QueueSettings = field(default_factory=QueueSettings)
    # `fair`: bands, tenant fairness and backfill; `fcfs`: strict arrival order.
    order: Literal["fair", "fcfs"] = "fair"
    # The adaptive policy's feedback on measured usage (off: ceilings alone).
    feedback: bool = True
    # Replicas share their state through a store (kvgate.core.replicas): every
    # `sync_interval_s` each publishes its view and reads the others' in one atomic exchange
    # at the store, `store_latency_s / 2` each way. None: replicas know only their own requests.
    sync_interval_s: float | None = None
    store_latency_s: float = 0.001
    scrape_interval_s: float = 0.05
    scrape_lag_s: float = 0.01
    client: ClientModel = field(default_factory=ClientModel)
    series_interval_s: float = 1.0
    token_update_interval_s: float = 0.5
    drain_s: float = 0.0
    seed: int = 0
    # Engines record their KV events (with `engine.enable_prefix_caching`) and the runner
    # hands each step's batch to the policies that take them (`KVEventSink`): every replica
    # subscribed to every engine, or only each engine's owner, the others through its view
    # (`kvgate.sim.kv_fanout`; needs `sync_interval_s`).
    kv_events: bool = False
    kv_events_via: KVEventsVia = "subscribe"


@dataclass(slots=True)
class RequestOutcome:
    """One client request across all its attempts. Times are virtual seconds."""

    index: int
    id: str
    kind: str
    arrival: float
    prompt_tokens: int
    max_tokens: int
    priority: str
    stream: bool
    # ok | gave_up_429 | gave_up_timeout | gave_up_5xx | bad_request | unfinished
    status: str = "pending"
    tries: list[Attempt] = field(default_factory=list)  # every try, 429s included
    attempts: int = 0  # tries sent to an engine
    rejections_429: int = 0
    rejections_5xx: int = 0
    timeouts: int = 0
    retries: int = 0
    first_token_at: float | None = None
    completed_at: float | None = None
    output_tokens: int = 0
    zombie_tokens: int = 0
    preemptions: int = 0
    node: str | None = None

    @property
    def ttft(self) -> float | None:
        """From the client's first try to its first token (retries included)."""
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.completed_at is None or self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.completed_at - self.first_token_at) / (self.output_tokens - 1)


@dataclass(slots=True)
class SeriesPoint:
    """Cluster state at `t` and event counts over the interval that ends at `t`."""

    t: float
    kv_usage_mean: float
    kv_usage_max: float
    node_kv_usage: list[float]
    node_running: list[int]
    node_waiting: list[int]
    running: int
    waiting: int
    arrivals: int
    admissions: int
    rejections: int
    timeouts: int
    completions: int
    preemptions: int
    generated_tokens: int
    zombie_tokens: int
    queued: int


@dataclass(slots=True)
class VirtualResult:
    config: VirtualConfig
    outcomes: list[RequestOutcome]
    series: list[SeriesPoint]
    wall_s: float
    events: int
    engine_totals: dict[str, int]

    def summary(self) -> dict[str, Any]:
        """Headline numbers (counts, goodput, latency percentiles of successful requests)."""
        by_status: dict[str, int] = {}
        for o in self.outcomes:
            by_status[o.status] = by_status.get(o.status, 0) + 1
        ok = [o for o in self.outcomes if o.status == "ok"]
        ttfts = sorted(o.ttft for o in ok if o.ttft is not None)
        tpots = sorted(t for o in ok if (t := o.tpot) is not None)
        horizon = self.config.duration_s + self.config.drain_s
        return {
            "requests": len(self.outcomes),
            "by_status": by_status,
            "goodput_tokens_per_s": sum(o.output_tokens for o in ok) / horizon,
            "ttft_p50_s": _pct(ttfts, 0.5),
            "ttft_p99_s": _pct(ttfts, 0.99),
            "tpot_p50_s": _pct(tpots, 0.5),
            "tpot_p99_s": _pct(tpots, 0.99),
            "rejections_429": sum(o.rejections_429 for o in self.outcomes),
            "timeouts": sum(o.timeouts for o in self.outcomes),
            **self.engine_totals,
            "wall_s": self.wall_s,
            "events": self.events,
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def series_point(
    now: float,
    engines: Sequence[Engine],
    counts: Mapping[str, int],
    last: tuple[int, int, int],
    queued: int,
) -> tuple[SeriesPoint, tuple[int, int, int]]:
    """The cluster at `now`, with the interval's event `counts` and `queued` waiters, and the
    engines' (preempted, generated, zombie) totals the next interval is counted from (`last`:
    those of the previous point)."""
    kv = [e.kv_usage for e in engines]
    preempted = sum(e.preemptions_evicted for e in engines)
    generated = sum(e.generation_tokens_total for e in engines)
    zombies = sum(e.zombie_tokens_total for e in engines)
    last_p, last_g, last_z = last
    point = SeriesPoint(
        t=now,
        kv_usage_mean=sum(kv) / len(kv),
        kv_usage_max=max(kv),
        node_kv_usage=kv,
        node_running=[e.num_running for e in engines],
        node_waiting=[e.num_waiting for e in engines],
        running=sum(e.num_running for e in engines),
        waiting=sum(e.num_waiting for e in engines),
        arrivals=counts["arrivals"],
        admissions=counts["admissions"],
        rejections=counts["rejections"],
        timeouts=counts["timeouts"],
        completions=counts["completions"],
        preemptions=preempted - last_p,
        generated_tokens=generated - last_g,
        zombie_tokens=zombies - last_z,
        queued=queued,
    )
    return point, (preempted, generated, zombies)


def scrape(engine: Engine, now: float, seen: list[tuple[float, int]], i: int) -> NodeSample:
    """What a scrape of `engine` (node `i`) at `now` tells a replica; `seen[i]` is the ITL
    histogram's (sum, count) at that replica's previous scrape, and is moved on."""
    itl = engine.itl
    prev_sum, prev_count = seen[i]
    latency = None
    if itl.count > prev_count:
        latency = (itl.sum - prev_sum) / (itl.count - prev_count)
    seen[i] = (itl.sum, itl.count)
    return NodeSample(
        kv_usage=engine.kv_usage,
        kv_capacity_tokens=engine.config.kv_capacity_tokens,
        running=engine.num_running,
        waiting=engine.num_waiting,
        iteration_latency_s=latency,
        sampled_at=now,
        preemptions_total=float(engine.preemptions_total),
        block_size=engine.config.block_size if engine.config.enable_prefix_caching else None,
    )


def engine_totals(engines: Sequence[Engine]) -> dict[str, int]:
    """The engines' counters summed over a run."""
    totals = {"preemptions": 0, "recomputed_tokens": 0, "zombie_tokens": 0,
              "generated_tokens": 0, "engine_steps": 0, "prefix_cache_queries": 0,
              "prefix_cache_hits": 0}  # fmt: skip
    for e in engines:
        totals["prefix_cache_queries"] += e.prefix_cache_queries_total
        totals["prefix_cache_hits"] += e.prefix_cache_hits_total
        totals["preemptions"] += e.preemptions_evicted
        totals["recomputed_tokens"] += e.recomputed_tokens_total
        totals["zombie_tokens"] += e.zombie_tokens_total
        totals["generated_tokens"] += e.generation_tokens_total
        totals["engine_steps"] += e.steps_total
    return totals
