"""The cost estimator: shapes of bodies, learning, exact counts handed in.

Counting a prompt exactly (a tokenizer, the engine's `/tokenize`) is the shell's work
(tests/gateway/tokens); the core takes the count as a `PromptCount`.
"""

from __future__ import annotations

import math

import pytest

from kvgate.core.cost import MESSAGE_OVERHEAD_CHARS, CostError, CostEstimator, PromptCount

from .helpers import admission_settings


def estimator(**overrides: object) -> CostEstimator:
    return CostEstimator(admission_settings(**overrides))


def test_prompt_string_and_default_cap() -> None:
    est = estimator(chars_per_token=4.0, prompt_safety_factor=1.0, default_max_tokens=300)
    cost = est.estimate("m", {"prompt": "x" * 400})
    assert (cost.prompt_tokens, cost.max_output_tokens) == (100, 300)


def test_safety_factor_rounds_up() -> None:
    cost = estimator(chars_per_token=4.0).estimate("m", {"prompt": "x" * 400, "max_tokens": 7})
    assert cost.prompt_tokens == math.ceil(100 * 1.1)
    assert cost.max_output_tokens == 7


def test_chat_messages_count_every_string_and_template_overhead() -> None:
    est = estimator(chars_per_token=1.0, prompt_safety_factor=1.0)
    body = {
        "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "efgh"}]},
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
        ],
        "max_completion_tokens": 5,
        "max_tokens": 999,
    }
    cost = est.estimate("m", body)
    strings = len("system") + 4 + len("user") + len("text") + 4 + len("assistant") + 2
    assert cost.prompt_tokens == strings + 3 * MESSAGE_OVERHEAD_CHARS
    assert cost.max_output_tokens == 5  # max_completion_tokens wins


def test_token_ids_are_exact_and_batches_and_n_multiply() -> None:
    est = estimator(chars_per_token=4.0, prompt_safety_factor=1.0)
    assert est.estimate("m", {"prompt": [1, 2, 3], "max_tokens": 10}).prompt_tokens == 3
    batch = est.estimate("m", {"prompt": ["x" * 40, [1, 2]], "max_tokens": 10})
    assert (batch.prompt_tokens, batch.max_output_tokens) == (12, 20)
    n = est.estimate("m", {"prompt": "x" * 40, "max_tokens": 10, "n": 3})
    assert (n.prompt_tokens, n.max_output_tokens) == (30, 30)


def test_within_a_known_context_no_sequence_holds_more_and_no_cap_means_the_rest() -> None:
    """vLLM stops each sequence at the context and, without `max_tokens`, generates up to
    it: that rest is the cap of a request that names none (`open_output`); one that names
    a larger cap is cut to it. Text prompts leave the rest after their floor (4 characters
    a token at most), so the cap is never below what the engine may generate."""
    est = estimator(chars_per_token=4.0, prompt_safety_factor=1.0, default_max_tokens=300)
    ids = est.estimate("m", {"prompt": list(range(1500))}, context=2048)
    assert (ids.prompt_tokens, ids.max_output_tokens, ids.open_output) == (1500, 548, True)
    asked = est.estimate("m", {"prompt": list(range(1500)), "max_tokens": 1000}, context=2048)
    assert (asked.max_output_tokens, asked.open_output) == (548, False)
    small = est.estimate("m", {"prompt": list(range(1500)), "max_tokens": 7}, context=2048)
    assert small.max_output_tokens == 7
    n = est.estimate("m", {"prompt": list(range(100)), "n": 2}, context=2048)
    assert (n.prompt_tokens, n.max_output_tokens) == (200, 2 * (2048 - 100))
    text = estimator(chars_per_token=3.0, prompt_safety_factor=1.1).estimate(
        "m", {"prompt": "x" * 4000}, context=2048
    )
    assert text.prompt_floor == 1000 and text.max_output_tokens == 2048 - 1000
    assert est.estimate("m", {"prompt": list(range(10))}).max_output_tokens == 300  # no context


def test_an_open_output_is_never_what_makes_a_request_too_big() -> None:
    """`floor_total` is what a request needs at the least: the output it asked for, and a
    token of output when it named none (its cap is then the engine's, not its own)."""
    est = estimator(chars_per_token=4.0, prompt_safety_factor=1.0)
    assert est.estimate("m", {"prompt": list(range(100))}, context=2048).floor_total == 101
    assert est.estimate("m", {"prompt": list(range(100)), "max_tokens": 50}).floor_total == 150


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": "9"}, "max_tokens"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens"),
        ({"prompt": "a", "n": -1}, "n"),
    ],
)
def test_bad_bodies_raise_cost_error(body: dict, param: str) -> None:
    with pytest.raises(CostError) as info:
        estimator().estimate("m", body)
    assert info.value.param == param


def test_deeply_nested_body_is_bounded() -> None:
    nested: object = "x" * 10
    for _ in range(1000):
        nested = [nested]
    cost = estimator().estimate("m", {"messages": [{"role": "user", "content": nested}]})
    assert cost.prompt_tokens > 0


def test_ratio_learns_from_usage_and_stays_clamped() -> None:
    est = estimator(chars_per_token=4.0, chars_per_token_min=1.0, chars_per_token_max=8.0)
    text = est.basis("m", {"prompt": "x" * 3000})
    for _ in range(100):
        est.learn(text, 1000)  # truly 3 chars per token
    assert abs(est.ratio("m") - 3.0) < 0.05
    assert est.ratio("other") == 4.0  # per model
    for _ in range(200):
        est.learn(text, 1)
    assert est.ratio("m") == 8.0
    est.learn(text, 0)  # ignored
    assert est.ratio("m") == 8.0


def test_the_first_observation_replaces_the_cautious_prior() -> None:
    """The prior (3 characters a token, padded by the safety factor) charges a 400-token
    prompt about 1.5 times over: one request's usage is enough to cost the next at what
    the engine counts, padded only by the safety factor. (An average moving a tenth of the
    way per request took some 30 requests to come within 5 %.)"""
    est = estimator()  # prior 3.0, safety factor 1.1
    body = {"prompt": "hello " * 400, "max_tokens": 400}
    first = est.estimate("m", body)
    assert first.prompt_tokens == math.ceil(2400 / 3.0 * 1.1)
    assert est.learn(est.basis("m", body), 400)  # the ratio moved: worth re-costing
    assert est.ratio("m") == 6.0
    assert est.estimate("m", body).prompt_tokens == math.ceil(400 * 1.1)
    assert not est.learn(est.basis("m", body), 401)  # a change too small to act on


def test_learning_weighs_text_by_its_length() -> None:
    """A ratio of sums: a long prompt moves the ratio more than a short one."""
    est = estimator()
    est.learn(est.basis("m", {"prompt": "a" * 8000}), 2000)  # 4 characters a token
    est.learn(est.basis("m", {"prompt": "b" * 200}), 100)  # 2 characters a token
    assert 3.8 < est.ratio("m") < 4.0


def test_learned_estimate_with_safety_factor_does_not_undercount() -> None:
    est = estimator()
    body = {"prompt": "y" * 5000}
    for _ in range(60):
        est.learn(est.basis("m", body), 1500)
    assert est.estimate("m", body).prompt_tokens >= 1500


def test_an_exact_count_replaces_the_estimate_and_brings_the_ids() -> None:
    est = estimator(chars_per_token=4.0)
    body = {"prompt": "the quick brown fox", "max_tokens": 10, "n": 2}
    count = PromptCount((5,), ids=(1, 2, 3, 4, 5), source="engine")
    basis = est.basis("m", body).with_count(count)
    assert (basis.ids, basis.source, basis.exact) == ((1, 2, 3, 4, 5), "engine", True)
    cost = est.price(basis)
    assert (cost.prompt_tokens, cost.prompt_floor, cost.prompt_exact) == (10, 10, True)
    assert cost.max_output_tokens == 20
    assert est.estimate("m", body, count=count) == cost
    # A count without one entry per prompt is not this body's: the estimate stands.
    batch = est.basis("m", {"prompt": ["a" * 40, "b" * 40]})
    assert batch.with_count(count) is batch and not est.price(batch).prompt_exact
    # Counted bases teach nothing more: no text is left to learn from.
    assert not est.learn(basis, 7)
    assert est.ratio("m") == 4.0


def test_token_ids_travel_with_the_basis() -> None:
    est = estimator()
    assert est.basis("m", {"prompt": [5, 6, 7]}).ids == (5, 6, 7)
    assert est.basis("m", {"prompt": [5, 6, 7]}).source == "ids"
    assert est.basis("m", {"prompt": [[5, 6], [7]]}).ids is None  # a batch: several prompts
    assert est.basis("m", {"prompt": "x"}).ids is None


def test_learning_counts_the_prompt_once_and_only_its_estimated_part() -> None:
    est = estimator(chars_per_token=4.0)
    # n = 4: the reservation holds four prompt copies; the engine reports the prompt once.
    for _ in range(50):
        est.learn(est.basis("m", {"prompt": "z" * 3000, "n": 4, "max_tokens": 5}), 1000)
    assert abs(est.ratio("m") - 3.0) < 0.05
    # Token ids are exact: nothing to learn from them.
    est.learn(est.basis("ids", {"prompt": list(range(500))}), 800)
    assert est.ratio("ids") == 4.0
    # A batch mixing ids and text learns from the text's share only.
    for _ in range(50):
        est.learn(est.basis("mix", {"prompt": [list(range(100)), "q" * 2000]}), 100 + 1000)
    assert abs(est.ratio("mix") - 2.0) < 0.05


def test_a_fixed_engine_default_caps_an_open_output() -> None:
    """vLLM's completions generate 16 tokens when `max_tokens` is absent: the shell hands
    that in as `implicit_output`, and the cost is that, not the rest of the context."""
    est = estimator(chars_per_token=4.0, prompt_safety_factor=1.0, default_max_tokens=300)
    body = {"prompt": list(range(100))}
    assert est.estimate("m", body, 2048, implicit_output=16).max_output_tokens == 16
    assert est.estimate("m", body, None, implicit_output=16).max_output_tokens == 16
    assert est.estimate("m", {**body, "n": 2}, 2048, implicit_output=16).max_output_tokens == 32
    near_the_end = {"prompt": list(range(2040))}
    assert est.estimate("m", near_the_end, 2048, implicit_output=16).max_output_tokens == 8
    asked = est.estimate("m", {**body, "max_tokens": 500}, 2048, implicit_output=16)
    assert asked.max_output_tokens == 500
    assert est.estimate("m", body, 2048).max_output_tokens == 1948  # chat: the rest


def test_longest_prompt_is_what_an_engine_compares_with_its_context() -> None:
    """Per prompt (not summed over a batch or `n`), and estimated without the margin."""
    est = estimator(chars_per_token=4.0)  # safety factor 1.1

    def longest(body: dict) -> tuple[int, bool]:
        return est.longest_prompt(est.basis("m", body))

    assert longest({"prompt": list(range(3000))}) == (3000, True)
    assert longest({"prompt": "x" * 400, "n": 4}) == (100, False)
    assert est.estimate("m", {"prompt": "x" * 400}).prompt_tokens == math.ceil(100 * 1.1)
    assert longest({"prompt": ["x" * 40, list(range(50)), "x" * 80]}) == (50, True)
    tokens, exact = longest({"messages": [{"role": "user", "content": "x" * 400}]})
    assert tokens == math.ceil((len("user") + 400 + MESSAGE_OVERHEAD_CHARS) / 4) and not exact
    counted = est.basis("m", {"messages": [{"role": "user", "content": "hi"}]})
    assert est.longest_prompt(counted.with_count(PromptCount((9,)))) == (9, True)
