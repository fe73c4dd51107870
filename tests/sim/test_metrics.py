"""The simulated /metrics page: vLLM's names and types, parseable, equal to engine state."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim.metrics import MetricsPage, only_samples
from kvgate.sim.model.engine import Engine
from kvgate.sim.presets import CPU_TINY
from kvgate.testing import overloaded_engine

# The real vLLM CPU engine's page after an overload (committed in
# tests/adapters/pages/vllm.txt, so the test needs nothing outside the repository).
REAL_SAMPLE = Path(__file__).resolve().parents[1] / "adapters" / "pages" / "vllm.txt"
REQUIRED = {
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:cache_config_info": "gauge",
    "vllm:generation_tokens": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "sim:zombie_tokens": "counter",
    "sim:recomputed_tokens": "counter",
}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, sample: str | None = None, **labels: str) -> float:
    for s in fams[name].samples:
        if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(name)


def test_page_parses_and_matches_engine_state() -> None:
    engine = overloaded_engine()
    snap = engine.metrics_snapshot()
    assert snap.preemptions_evicted > 0 and snap.running > 0 and snap.waiting > 0
    fams = families(MetricsPage(engine, "sim-llama").render())
    for name, kind in REQUIRED.items():
        assert fams[name].type == kind, name
        for s in fams[name].samples:
            assert s.labels["engine"] == "0" and s.labels["model_name"] == "sim-llama"
    assert value(fams, "vllm:num_requests_running") == snap.running
    assert value(fams, "vllm:num_requests_waiting") == snap.waiting
    assert value(fams, "vllm:kv_cache_usage_perc") == snap.kv_usage
    assert 0.9 < snap.kv_usage <= 1.0
    assert value(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == (
        snap.preemptions_total
    )
    assert value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == (
        snap.generation_tokens_total
    )
    assert value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == (
        snap.prompt_tokens_total
    )
    assert (
        value(fams, "sim:recomputed_tokens", "sim:recomputed_tokens_total")
        == (snap.recomputed_tokens_total)
        > 0
    )
    assert (
        value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        == snap.success_total["length"]
    )
    itl_count = value(
        fams, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count"
    )
    assert itl_count == snap.itl.count
    inf = value(
        fams,
        "vllm:inter_token_latency_seconds",
        "vllm:inter_token_latency_seconds_bucket",
        le="+Inf",
    )
    assert inf == snap.itl.count
    ttft_sum = value(
        fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum"
    )
    assert abs(ttft_sum - snap.ttft.sum) < 1e-9
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["num_gpu_blocks"] == "128" and info["block_size"] == "32"


def test_names_types_and_buckets_match_the_real_vllm_page() -> None:
    real = families(REAL_SAMPLE.read_text())
    ours = families(MetricsPage(Engine(CPU_TINY), "tiny-llama").render())
    for name, kind in REQUIRED.items():
        if name.startswith("sim:"):
            continue
        assert real[name].type == kind == ours[name].type, name
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:iteration_tokens_total",
    ):
        assert bucket_bounds(ours, hist) == bucket_bounds(real, hist), hist


def bucket_bounds(fams: dict, hist: str) -> list[str]:
    return [s.labels["le"] for s in fams[hist].samples if s.name.endswith("_bucket")]


def test_named_samples_are_what_prometheus_client_returns_for_the_same_names() -> None:
    """`only_samples` (the simulator's `/metrics/?name[]=`) against prometheus_client's own
    restricted exposition of a registry with the same families."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    labels = ("engine", "model_name")
    Gauge("vllm:num_requests_running", "Running.", labels, registry=registry).labels("0", "m").set(
        3
    )
    Counter("vllm:num_preemptions", "Preemptions.", labels, registry=registry).labels("0", "m").inc(
        2
    )
    itl = Histogram("vllm:inter_token_latency_seconds", "ITL.", labels, registry=registry)
    itl.labels("0", "m").observe(0.02)
    names = frozenset(
        {
            "vllm:num_requests_running",
            "vllm:num_preemptions_total",
            "vllm:inter_token_latency_seconds_sum",
            "vllm:inter_token_latency_seconds_count",
            "vllm:not_on_the_page",
        }
    )
    full = generate_latest(registry).decode()
    expected = generate_latest(registry.restricted_registry(names)).decode()
    # The same families line for line; prometheus_client's order of families is a set's.
    assert _families(only_samples(full, names)) == _families(expected)
    assert len(_families(expected)) == 3
    assert only_samples(full, frozenset({"vllm:not_on_the_page"})) == ""


def _families(page: str) -> set[str]:
    """A page as its families' text blocks (each from its `# HELP` line on)."""
    return {"# HELP" + block for block in page.split("# HELP")[1:]}
