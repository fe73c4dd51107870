"""Small real tokenizers, trained in memory and written as a model directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

#: A chat template like the real-engine model's (tests/real_engine): role markers, newlines.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42  # it's the answer\n",
    "You are a helpful assistant. Answer briefly, and don't guess.",
    "Numbers 1234 and 5678, prices $9.99; emails a@b.c\n\nNew paragraph here.",
]


def train(byte_level: bool = True, normalizer: bool = False) -> Tokenizer:
    """A byte-level BPE like GPT-2's (every byte in the vocabulary, `<s>` and `</s>` added),
    or, with `byte_level` False, a whitespace-split BPE that only the reference encodes."""
    tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    if normalizer:
        tok.normalizer = normalizers.Lowercase()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 40, trainer)
    return tok


def model_dir(
    path: Path,
    tokenizer: Tokenizer | None = None,
    template: str | None = TEMPLATE,
    **config: Any,
) -> Path:
    """A model directory: tokenizer.json and tokenizer_config.json (with `template` as its
    chat_template, and `config`'s entries)."""
    path.mkdir(parents=True, exist_ok=True)
    (tokenizer or train()).save(str(path / "tokenizer.json"))
    settings: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", **config}
    if template is not None:
        settings["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def reference_ids(tokenizer: Tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=special).ids)
