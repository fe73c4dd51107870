"""Each dialect on a real page of its engine, plus the edge cases of its aggregation."""

from __future__ import annotations

import math

import pytest

from kvgate.adapters import KINDS, adapter_for
from kvgate.adapters.base import HistogramDelta, MetricScanner, MetricsParseError, Series

from .pages import drop_lines, page, replace_line

# ---- vLLM: pages/vllm.txt, a whole page of the real engine (scripts/real-vllm/) ----------


def test_vllm_real_page() -> None:
    sample = adapter_for("vllm").parse(page("vllm"), now=12.5)
    assert sample.kv_usage == 0.0
    assert sample.kv_capacity_tokens == 128 * 32  # num_gpu_blocks x block_size labels
    assert (sample.running, sample.waiting) == (0, 0)
    assert sample.preemptions_total == 42.0
    # First scrape: the mean of everything the engine's histogram holds.
    assert sample.iteration_latency_s == pytest.approx(233.51562482099848 / 28989.0)
    assert sample.sampled_at == 12.5


def _vllm_with(usage: str, running: str, waiting: str, count: str, total: str) -> bytes:
    text = page("vllm")
    text = replace_line(
        text,
        b"vllm:kv_cache_usage_perc{",
        b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} ' + usage.encode(),
    )
    text = replace_line(
        text,
        b"vllm:num_requests_running{",
        b'vllm:num_requests_running{engine="0",model_name="tiny-llama"} ' + running.encode(),
    )
    text = replace_line(
        text,
        b"vllm:num_requests_waiting{",
        b'vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} ' + waiting.encode(),
    )
    text = replace_line(
        text,
        b"vllm:inter_token_latency_seconds_count{",
        b'vllm:inter_token_latency_seconds_count{engine="0",model_name="tiny-llama"} '
        + count.encode(),
    )
    return replace_line(
        text,
        b"vllm:inter_token_latency_seconds_sum{",
        b'vllm:inter_token_latency_seconds_sum{engine="0",model_name="tiny-llama"} '
        + total.encode(),
    )


def test_vllm_iteration_latency_is_the_delta_between_scrapes() -> None:
    adapter = adapter_for("vllm")
    first = adapter.parse(_vllm_with("0.5", "7.0", "2.0", "1000.0", "8.0"), now=1.0)
    assert first.iteration_latency_s == pytest.approx(8.0 / 1000)  # its history's mean
    second = adapter.parse(_vllm_with("0.75", "6.0", "4.0", "1100.0", "8.5"), now=1.05)
    assert second.iteration_latency_s == pytest.approx(0.5 / 100)
    assert (first.iteration_tokens, second.iteration_tokens) == (1000, 100)  # their weights
    assert (second.kv_usage, second.running, second.waiting) == (0.75, 6, 4)
    idle = adapter.parse(_vllm_with("0.75", "6.0", "4.0", "1100.0", "8.5"), now=1.1)
    assert idle.iteration_latency_s is None  # no token in between: no latency, not zero
    assert idle.iteration_tokens is None
    restarted = adapter.parse(_vllm_with("0.0", "0.0", "0.0", "3.0", "0.01"), now=1.2)
    # Counters went back: the engine restarted, and its new history's mean counts.
    assert restarted.iteration_latency_s == pytest.approx(0.01 / 3)
    fresh = adapter_for("vllm").parse(_vllm_with("0.0", "0.0", "0.0", "0.0", "0.0"), now=1.0)
    assert fresh.iteration_latency_s is None  # an engine that never made a token


def test_vllm_falls_back_to_the_old_usage_name() -> None:
    text = page("vllm").replace(b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
    text = replace_line(
        text, b"vllm:gpu_cache_usage_perc{", b'vllm:gpu_cache_usage_perc{engine="0"} 0.625'
    )
    assert adapter_for("vllm").parse(text, 0.0).kv_usage == 0.625


def test_vllm_data_parallel_engines_are_combined() -> None:
    """Engine 0: 128 blocks x 32 full; engine 1: 384 blocks x 32 at 0.25 usage.
    Capacity-weighted: (4096 * 1.0 + 12288 * 0.25) / 16384 = 0.4375; counts add up.
    As in a real DP page, each engine-1 line sits in its family's group, after engine 0's."""
    base = replace_line(
        page("vllm"), b"vllm:kv_cache_usage_perc{", b'vllm:kv_cache_usage_perc{engine="0"} 1.0'
    )
    engine1 = {
        b"vllm:cache_config_info{": None,  # copy of engine 0's line with 384 blocks
        b"vllm:kv_cache_usage_perc{": b'vllm:kv_cache_usage_perc{engine="1"} 0.25',
        b"vllm:num_requests_running{": b'vllm:num_requests_running{engine="1"} 3.0',
        b"vllm:num_requests_waiting{": b'vllm:num_requests_waiting{engine="1"} 1.0',
        b"vllm:num_preemptions_total{": b'vllm:num_preemptions_total{engine="1"} 8.0',
    }
    lines = []
    for line in base.split(b"\n"):
        lines.append(line)
        for prefix, extra in engine1.items():
            if line.startswith(prefix):
                if extra is None:
                    extra = line.replace(b'engine="0"', b'engine="1"').replace(
                        b'num_gpu_blocks="128"', b'num_gpu_blocks="384"'
                    )
                lines.append(extra)
    sample = adapter_for("vllm").parse(b"\n".join(lines), 0.0)
    assert sample.kv_usage == pytest.approx(0.4375)
    assert sample.kv_capacity_tokens == 4096 + 12288
    assert (sample.running, sample.waiting) == (3, 1)
    assert sample.preemptions_total == 50.0


def test_scanner_reads_a_metric_group_until_the_next_family() -> None:
    """A metric's lines form one group (exposition format); the scan stops at the next
    family's comment, and pages without comments are read to the end."""
    scanner = MetricScanner(["m"])
    grouped = b'# TYPE m gauge\nm{e="0"} 1\nm{e="1"} 2\n# TYPE n gauge\nn 5\n'
    assert [s.value for s in scanner.scan(grouped)["m"]] == [1.0, 2.0]
    bare = b'm{e="0"} 1\nn 5\nm{e="1"} 2\n'
    assert [s.value for s in scanner.scan(bare)["m"]] == [1.0, 2.0]


@pytest.mark.parametrize(
    ("bad_value", "why"),
    [("NaN", "finite"), ("+Inf", "finite"), ("1.5", "outside"), ("-0.1", "outside")],
)
def test_vllm_rejects_impossible_usage(bad_value: str, why: str) -> None:
    text = replace_line(
        page("vllm"),
        b"vllm:kv_cache_usage_perc{",
        b'vllm:kv_cache_usage_perc{engine="0"} ' + bad_value.encode(),
    )
    with pytest.raises(MetricsParseError, match=why):
        adapter_for("vllm").parse(text, 0.0)


def test_vllm_rejects_negative_counts_and_non_numbers() -> None:
    negative = replace_line(
        page("vllm"), b"vllm:num_requests_waiting{", b'vllm:num_requests_waiting{engine="0"} -2'
    )
    with pytest.raises(MetricsParseError, match="negative"):
        adapter_for("vllm").parse(negative, 0.0)
    word = replace_line(
        page("vllm"), b"vllm:num_requests_running{", b'vllm:num_requests_running{engine="0"} lots'
    )
    with pytest.raises(MetricsParseError, match="not a number"):
        adapter_for("vllm").parse(word, 0.0)


@pytest.mark.parametrize(
    "metric",
    [b"vllm:kv_cache_usage_perc{", b"vllm:num_requests_running{", b"vllm:num_requests_waiting{"],
)
def test_vllm_missing_required_metric_is_an_error(metric: bytes) -> None:
    with pytest.raises(MetricsParseError, match="required metric missing"):
        adapter_for("vllm").parse(drop_lines(page("vllm"), metric), 0.0)


def test_vllm_without_cache_info_has_unknown_capacity() -> None:
    sample = adapter_for("vllm").parse(drop_lines(page("vllm"), b"vllm:cache_config_info{"), 0.0)
    assert sample.kv_capacity_tokens is None
    assert sample.kv_usage == 0.0


# ---- SGLang: docs/references/production_metrics.md of sgl-project/sglang ---------------------


def test_sglang_real_page() -> None:
    adapter = adapter_for("sglang")
    sample = adapter.parse(page("sglang"), 3.0)
    assert sample.kv_usage == pytest.approx(0.28)
    assert (sample.running, sample.waiting) == (162, 2826)
    assert sample.kv_capacity_tokens is None  # this version exports no pool size
    # time_per_output_token histogram (this version has no inter_token_latency): delta
    model = b'{model_name="meta-llama/Llama-3.1-8B-Instruct"} '
    tpot = b"sglang:time_per_output_token_seconds"
    later = (
        page("sglang")
        .replace(
            tpot + b"_sum" + model + b"866964.5791549598",
            tpot + b"_sum" + model + b"866974.5791549598",
        )
        .replace(
            tpot + b"_count" + model + b"7.400757e+06", tpot + b"_count" + model + b"7.401257e+06"
        )
    )
    later_sample = adapter.parse(later, 3.05)
    assert later_sample.iteration_latency_s == pytest.approx(10.0 / 500)
    assert later_sample.iteration_tokens == pytest.approx(500)


def test_sglang_capacity_and_dp_ranks() -> None:
    """Newer SGLang: cache_config_info{page_size,num_pages}; two DP ranks, each exported by
    two TP ranks (copies: max, not sum)."""
    lines = [
        'sglang:cache_config_info{dp_rank="0",num_pages="1000",page_size="16"} 1.0',
        'sglang:cache_config_info{dp_rank="1",num_pages="3000",page_size="16"} 1.0',
    ]
    for dp, usage, running, queued in (("0", 0.8, 10, 4), ("1", 0.2, 6, 0)):
        for tp in ("0", "1"):
            labels = f'dp_rank="{dp}",tp_rank="{tp}"'
            lines += [
                f"sglang:token_usage{{{labels}}} {usage}",
                f"sglang:num_running_reqs{{{labels}}} {running}",
                f"sglang:num_queue_reqs{{{labels}}} {queued}",
            ]
    sample = adapter_for("sglang").parse(("\n".join(lines) + "\n").encode(), 0.0)
    assert sample.kv_capacity_tokens == 16000 + 48000
    assert sample.kv_usage == pytest.approx((16000 * 0.8 + 48000 * 0.2) / 64000)
    assert (sample.running, sample.waiting) == (16, 4)


def test_sglang_old_pool_gauge_gives_capacity() -> None:
    text = page("sglang") + b'sglang:max_total_num_tokens{model_name="m"} 442353.0\n'
    assert adapter_for("sglang").parse(text, 0.0).kv_capacity_tokens == 442353


# ---- Triton + TensorRT-LLM: tensorrtllm_backend README --------------------------------------


def test_triton_real_page() -> None:
    sample = adapter_for("triton").parse(page("triton"), 0.0)
    assert sample.kv_usage == pytest.approx(0.4875)  # the backend's own fraction gauge
    assert sample.kv_capacity_tokens == 6239 * 64
    assert (sample.running, sample.waiting) == (1, 1)  # scheduled, waiting
    assert sample.iteration_latency_s is None


def test_triton_without_fraction_uses_used_over_max() -> None:
    text = drop_lines(page("triton"), b'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fr')
    sample = adapter_for("triton").parse(text, 0.0)
    assert sample.kv_usage == pytest.approx(1 / 6239)


def test_triton_without_waiting_is_an_error() -> None:
    text = drop_lines(page("triton"), b'nv_trt_llm_request_metrics{model="tensorrt_llm",request_t')
    with pytest.raises(MetricsParseError):
        adapter_for("triton").parse(text, 0.0)


# ---- trtllm-serve, TGI (pages built from documented metric lists), llama.cpp -------------------


def test_trtllm_documented_page() -> None:
    adapter = adapter_for("trtllm")
    sample = adapter.parse(page("trtllm"), 0.0)
    assert sample.kv_usage == 0.25
    assert sample.kv_capacity_tokens == 8192 * 32
    assert (sample.running, sample.waiting) == (24, 3)


def test_tgi_documented_page() -> None:
    adapter = adapter_for("tgi", capacity_tokens=8192)
    sample = adapter.parse(page("tgi"), 0.0)
    assert sample.kv_usage == pytest.approx(2048 / 8192)  # reserved by the batch / budget
    assert (sample.running, sample.waiting) == (8, 5)
    later = (
        page("tgi")
        .replace(
            b'tgi_batch_forward_duration_sum{method="decode"} 4.0',
            b'tgi_batch_forward_duration_sum{method="decode"} 4.5',
        )
        .replace(
            b'tgi_batch_forward_duration_count{method="decode"} 200',
            b'tgi_batch_forward_duration_count{method="decode"} 220',
        )
    )
    later_sample = adapter.parse(later, 0.05)
    assert later_sample.iteration_latency_s == pytest.approx(0.5 / 20)
    assert later_sample.iteration_tokens == 20  # decode steps
    assert adapter_for("tgi").parse(page("tgi"), 0.0).kv_usage is None  # no budget known


def test_llamacpp_real_page_has_no_kv_gauge() -> None:
    adapter = adapter_for("llamacpp", capacity_tokens=8192)
    sample = adapter.parse(page("llamacpp"), 0.0)
    assert sample.kv_usage is None
    assert sample.kv_capacity_tokens == 8192
    assert (sample.running, sample.waiting) == (0, 0)
    later = (
        page("llamacpp")
        .replace(b"llamacpp:tokens_predicted_total 673", b"llamacpp:tokens_predicted_total 773")
        .replace(b"seconds_total 29.567", b"seconds_total 31.567")
    )
    later_sample = adapter.parse(later, 0.1)
    assert later_sample.iteration_latency_s == pytest.approx(2.0 / 100)
    assert later_sample.iteration_tokens == 100


def test_llamacpp_old_build_kv_ratio_is_used() -> None:
    text = page("llamacpp") + b"llamacpp:kv_cache_usage_ratio 0.42\n"
    assert adapter_for("llamacpp").parse(text, 0.0).kv_usage == pytest.approx(0.42)


# ---- all dialects ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_garbage_and_empty_pages_are_parse_errors(kind: str) -> None:
    for junk in (b"", b"<html>502 Bad Gateway</html>", b"\x00\xff" * 100, b"# only comments\n"):
        with pytest.raises(MetricsParseError):
            adapter_for(kind).parse(junk, 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_truncated_page_is_an_error_or_a_valid_sample(kind: str) -> None:
    """Cut anywhere: a clear error, or (every required line survived) a sane sample. HTTP
    framing (Content-Length, chunk ends) is what catches truncation in transit."""
    full = page(kind)
    errors = 0
    for cut in range(0, len(full), max(1, len(full) // 97)):
        try:
            part = adapter_for(kind, capacity_tokens=8192).parse(full[:cut], 0.0)
        except MetricsParseError:
            errors += 1
            continue
        assert part.running >= 0 and part.waiting >= 0
        assert part.kv_usage is None or 0.0 <= part.kv_usage <= 1.0
    assert errors > 0  # the short prefixes lack required metrics


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine kind"):
        adapter_for("ollama")


# ---- building blocks ------------------------------------------------------------------------


def test_scanner_ignores_longer_names_comments_and_reads_timestamps() -> None:
    scanner = MetricScanner(["a:b"])
    found = scanner.scan(
        b'# HELP a:b x\na:b 1\na:b_total 5\na:bc{x="1"} 7\na:b{l="}"} 2 1700000000000\n'
    )
    assert [s.value for s in found["a:b"]] == [1.0, 2.0]
    assert found["a:b"][1].labels() == {"l": "}"}


def test_scanner_rejects_a_malformed_wanted_line() -> None:
    with pytest.raises(MetricsParseError, match="unterminated"):
        MetricScanner(["m"]).scan(b'm{a="1" 3\n')["m"]
    with pytest.raises(MetricsParseError, match="malformed"):
        MetricScanner(["m"]).scan(b"m 1 2 3\n")["m"]


def test_histogram_delta() -> None:
    delta = HistogramDelta()
    assert delta.update(1.0, 10) == pytest.approx(0.1)  # first: the whole history's mean
    assert delta.update(3.0, 20) == pytest.approx(0.2) and delta.observed == 10
    assert delta.update(3.0, 20) is None and delta.observed is None
    assert delta.update(0.5, 5) == pytest.approx(0.1)  # reset: the new history's mean
    assert delta.update(0.7, 7) == pytest.approx(0.1)
    assert HistogramDelta().update(0.0, 0) is None
    assert not math.isnan(delta.update(0.7, 7) or 0.0)


def test_label_escapes_are_decoded_in_one_pass() -> None:
    series = Series(b'a="x\\\\ny",b="q\\"r",c="l1\\nl2",engine="0"', 1.0)
    assert series.labels() == {"a": "x\\ny", "b": 'q"r', "c": "l1\nl2", "engine": "0"}
    assert series.label("a") == "x\\ny" and series.label("engine") == "0"
    assert series.label("gine") is None  # a name that only ends another one


def test_vllm_block_size_and_prefix_cache_counters() -> None:
    """The block size kvgate hashes prompts by (only from an engine that caches prefixes:
    one that does not shares no block), and the engine's own prefix cache hit counters
    (prompt tokens found cached / looked up)."""
    plain = page("vllm")  # the real engine's page: enable_prefix_caching="False"
    assert adapter_for("vllm").parse(plain, 0.0).block_size is None
    text = plain.replace(b'enable_prefix_caching="False"', b'enable_prefix_caching="True"')
    text = replace_line(
        text,
        b"vllm:prefix_cache_queries_total{",
        b'vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 2048.0',
    )
    text = replace_line(
        text,
        b"vllm:prefix_cache_hits_total{",
        b'vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 1536.0',
    )
    sample = adapter_for("vllm").parse(text, 0.0)
    assert sample.block_size == 32
    assert sample.prefix_queries_total == 2048.0 and sample.prefix_hits_total == 1536.0
    bare = adapter_for("vllm").parse(drop_lines(text, b"vllm:prefix_cache_"), 0.0)
    assert bare.prefix_hits_total is None and bare.prefix_queries_total is None
