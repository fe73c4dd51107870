"""A model's tokenizer gives the reference tokenizer's ids, whichever path it takes:
`tiktoken` where the vocabulary converts and agrees, cut at lines where the pre-tokenizer
provably cuts there, remembered where the text repeats."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers

from gateway.tokens.helpers import CORPUS, model_dir, reference_ids, train
from kvgate.gateway.tokens.bpe import GPT2_PATTERN, LLAMA3_PATTERN, convert, pattern_of
from kvgate.gateway.tokens.files import load_tokenizers
from kvgate.gateway.tokens.model import ModelTokenizer
from kvgate.gateway.tokens.segments import SegmentCache

ALPHABET = "ab cd\n\n \t'sX9.,!é日😀<s>"


def random_texts(count: int, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        texts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 120))))
    return texts


def loaded(tmp_path: Path, tokenizer: Tokenizer) -> ModelTokenizer:
    return load_tokenizers({"m": str(model_dir(tmp_path / "m", tokenizer))})["m"]


def test_byte_level_bpe_takes_the_fast_path_and_gives_the_reference_ids(tmp_path: Path) -> None:
    tokenizer = train()
    model = loaded(tmp_path, tokenizer)
    assert model.fast and model.splits
    for text in [*CORPUS, *random_texts(300)]:
        assert model.prompt_ids(text) == reference_ids(tokenizer, text), repr(text)


def test_other_tokenizers_are_encoded_by_the_reference(tmp_path: Path) -> None:
    for tokenizer in (train(byte_level=False), train(normalizer=True)):
        model = ModelTokenizer(tokenizer, json.loads(tokenizer.to_str()))
        assert not model.fast and not model.splits
        for text in [*CORPUS, *random_texts(50)]:
            assert model.prompt_ids(text) == reference_ids(tokenizer, text)


def test_only_known_patterns_are_cut_at_lines() -> None:
    """A `Split` by Llama 3's pattern is cut at lines; one by any other pattern is not
    (the proof is for the patterns, not for regular expressions in general)."""
    tokenizer = train()
    for pattern, splits in ((LLAMA3_PATTERN, True), (r"\s+|\S+", False)):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        spec = json.loads(tokenizer.to_str())
        assert pattern_of(spec) == pattern
        converted = convert(spec)
        assert converted is not None and converted.splits_at_lines is splits
        model = ModelTokenizer(tokenizer, spec)
        for text in random_texts(100, seed=7):
            assert model.prompt_ids(text) == reference_ids(tokenizer, text), repr(text)
    assert pattern_of({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == GPT2_PATTERN
    assert pattern_of({"pre_tokenizer": {"type": "Whitespace"}}) is None


def test_repeated_text_is_remembered_and_the_memory_is_bounded() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    cache = SegmentCache(encode, split=True, max_tokens=200)
    system = "You are helpful.\nAnswer briefly.\n"
    first = cache.encode(system + "Question one?")
    assert first == [ord(c) for c in system + "Question one?"]
    assert calls == ["You are helpful.\n", "Answer briefly.\n", "Question one?"]
    calls.clear()
    cache.encode(system + "Question two?")
    assert calls == ["Question two?"]  # the system prompt's segments were remembered
    # A cut after a space is not safe (" \n" may be one piece): joined to the next.
    calls.clear()
    cache.encode("trailing \nnext")
    assert calls == ["trailing \nnext"]
    for i in range(100):  # far more than 200 tokens of new text
        cache.encode(f"line {i:03d}\nother {i:03d}")
    young, old = cache._young, cache._old
    remembered = sum(len(ids) + 1 for table in (*young, *old) for ids in table.values())
    assert remembered <= 200 + 20


def test_chats_the_template_cannot_promise_are_not_counted(tmp_path: Path) -> None:
    model = loaded(tmp_path, train())
    user = {"role": "user", "content": "hi"}
    assert model.chat_ids({"messages": [user]}) is not None
    for body in (
        {"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{**user, "tool_calls": []}]},
        {"messages": [user], "chat_template": "{{ 1 }}"},
        {"messages": []},
        {"messages": [user], "add_generation_prompt": "yes"},
    ):
        assert model.chat_ids(body) is None, body


def test_a_template_that_raises_is_not_counted(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no') }}{% endif %}x"
    model = load_tokenizers({"m": str(model_dir(tmp_path / "m", template=template))})["m"]
    assert model.chat_ids({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert model.chat_ids({"messages": [{"role": "system", "content": "hi"}]}) is not None


@pytest.mark.parametrize("text", ["a\n\nb", "x \ny", "\n\nz", "a\r\nb", "end\n", "<s>\n<s>"])
def test_edges_of_the_line_cut(tmp_path: Path, text: str) -> None:
    tokenizer = train()
    model = loaded(tmp_path, tokenizer)
    assert model.prompt_ids(text) == reference_ids(tokenizer, text)
    assert model.prompt_ids(text) == reference_ids(tokenizer, text)  # from the cache
