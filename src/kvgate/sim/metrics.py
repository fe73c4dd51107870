"""The `/metrics` page of a simulated engine, with vLLM's metric names, types and labels.

Rendered directly from the engine's counters rather than through `prometheus_client`
objects: the engine already keeps cumulative counts, and mirroring them into a registry
on every step would cost more than writing ~100 lines on demand (measured in
`benchmarks/sim_capacity/`). The output follows the text exposition format 0.0.4 exactly
as `prometheus_client` writes it (so `prometheus_client.parser` reads it back), with the
labels a real vLLM server puts on every sample: `engine` and `model_name`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.sim.model.engine import Engine
from kvgate.sim.model.histogram import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def _num(value: float) -> str:
    """Format a sample value the way prometheus_client does (floats, `+Inf`)."""
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def only_samples(page: str, names: frozenset[str]) -> str:
    """The page cut to the samples named in `names`, each family's `# HELP`/`# TYPE` kept
    when one of its samples is: what prometheus_client's `?name[]=` filter returns."""
    out: list[str] = []
    header: list[str] = []
    for line in page.splitlines():
        if line.startswith("#"):
            if line.startswith("# HELP"):
                header = []
            header.append(line)
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out.extend(header)
            header = []
            out.append(line)
    return "\n".join(out) + "\n" if out else ""


class MetricsPage:
    """Renders one engine's page; label strings are built once."""

    def __init__(
        self, engine: Engine, model_name: str, engine_label: str = "0", preset: str = "custom"
    ) -> None:
        self.engine = engine
        self.lag_source: Callable[[], float] | None = None
        self._eng = f'engine="{_escape(engine_label)}"'
        self._model = f'model_name="{_escape(model_name)}"'
        self._labels = f"{self._eng},{self._model}"
        cfg = engine.config
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": engine_label,
            "gpu_memory_utilization": "0.9",
            "kv_cache_size_tokens": str(cfg.usable_blocks * cfg.block_size),
            "model_name": model_name,
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_blocks),
            "sim_preset": preset,
        }
        self.set_info(info)

    def set_info(self, info: dict[str, str]) -> None:
        """Labels of `vllm:cache_config_info` (sorted, like prometheus_client writes them)."""
        self._info = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(info.items()))

    def render(self) -> str:
        e = self.engine
        lab = self._labels
        out: list[str] = []

        def scalar(name: str, kind: str, help_text: str, value: float) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.append(f"{name}{{{lab}}} {_num(value)}")

        scalar(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            e.num_running,
        )
        scalar(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            e.num_waiting,
        )
        out.append(
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason."
        )
        out.append("# TYPE vllm:num_requests_waiting_by_reason gauge")
        out.append(
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} {_num(e.num_waiting)}'
        )
        out.append(f'vllm:num_requests_waiting_by_reason{{{lab},reason="deferred"}} 0.0')
        scalar(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            e.kv_usage,
        )
        scalar(
            "vllm:num_preemptions_total",
            "counter",
            "Cumulative number of preemption from the engine.",
            e.preemptions_total,
        )
        scalar(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            e.prefix_cache_queries_total,
        )
        scalar(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            e.prefix_cache_hits_total,
        )
        scalar(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            e.prompt_tokens_total,
        )
        scalar(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            e.generation_tokens_total,
        )
        out.append("# HELP vllm:request_success_total Count of successfully processed requests.")
        out.append("# TYPE vllm:request_success_total counter")
        for reason in _FINISHED_REASONS:
            value = e.success_total.get(reason, 0)
            out.append(
                f"vllm:request_success_total{{{self._eng},"
                f'finished_reason="{reason}",{self._model}}} {_num(value)}'
            )
        self._histogram(
            out,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            e.iteration_tokens,
        )
        self._histogram(
            out,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            e.ttft,
        )
        self._histogram(
            out,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            e.itl,
        )
        self._histogram(
            out,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            e.e2e,
        )
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(f"vllm:cache_config_info{{{self._info}}} 1.0")
        scalar(
            "sim:zombie_tokens_total",
            "counter",
            "Tokens generated for requests whose client had already gone (simulator only).",
            e.zombie_tokens_total,
        )
        scalar(
            "sim:recomputed_tokens_total",
            "counter",
            "Prefill tokens computed again after a preemption (simulator only).",
            e.recomputed_tokens_total,
        )
        scalar(
            "sim:preemptions_evicted_total",
            "counter",
            "Preemptions counted when they happen, unlike vLLM's lazy count (simulator only).",
            e.preemptions_evicted,
        )
        scalar(
            "sim:busy_seconds_total",
            "counter",
            "Sum of modelled step durations (simulator only).",
            e.busy_seconds_total,
        )
        if self.lag_source is not None:
            scalar(
                "sim:step_lag_seconds_total",
                "counter",
                "Sum of how late the live simulator ended its steps against the model's "
                "back-to-back timeline; growing fast means the process cannot keep up "
                "(simulator only).",
                self.lag_source(),
            )
        out.append("")
        return "\n".join(out)

    def _histogram(self, out: list[str], name: str, help_text: str, hist: Histogram) -> None:
        eng, model = self._eng, self._model
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} histogram")
        cumulative = hist.cumulative()
        for bound, count in zip(hist.bounds, cumulative, strict=False):
            out.append(f'{name}_bucket{{{eng},le="{_num(bound)}",{model}}} {_num(count)}')
        out.append(f'{name}_bucket{{{eng},le="+Inf",{model}}} {_num(cumulative[-1])}')
        out.append(f"{name}_count{{{self._labels}}} {_num(hist.count)}")
        out.append(f"{name}_sum{{{self._labels}}} {_num(hist.sum)}")
