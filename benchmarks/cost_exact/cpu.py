"""kvgate's CPU per 1,000 prompt tokens to count prompts exactly, and to estimate them.

What the relay does in process for each completion or chat, timed alone: the counter's
local count (kvgate.gateway.tokens: the model's tokenizer, its chat template, the cache of
repeated segments) plus the core's basis and price. Prompts are real text (kvgate's own
source and docs, cut into prompts of about `--tokens` tokens), in four workloads:

- `fresh`: every prompt new (nothing repeats: the cache only costs);
- `system`: chats of one shared system prompt (about 1,000 tokens) and a fresh question;
- `history`: a conversation whose every turn resends the turns before it;
- `documents`: completions over 8 shared documents, each with a fresh question.

Ways compared: `kvgate` (what runs: tiktoken where it agrees, cut at lines, cached), and for
reference `tokenizers` (the reference tokenizer on the whole text, no cache), `tiktoken`
(the converted encoding on the whole text, no cache) and `estimate` (no count: the body
walked and priced by the learned ratio). Figures are CPU time of this process
(`time.process_time`), median of `--rounds` rounds, µs per 1,000 prompt tokens.

    python benchmarks/cost_exact/cpu.py [--model-dir DIR] [--rounds 5] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.core.cost import CostEstimator
from kvgate.core.settings import AdmissionSettings
from kvgate.gateway.tokens.counting import PromptCounter
from kvgate.gateway.tokens.files import load_tokenizers

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = Path.home() / ".cache" / "kvgate-vllm" / "tiny-llama"
MODEL = "m"


def source_text() -> str:
    files = sorted(glob.glob(str(ROOT / "src/kvgate/**/*.py"), recursive=True))
    files += sorted(glob.glob(str(ROOT / "docs/*.md")))
    return "".join(Path(f).read_text() for f in files)


def cut(text: str, chars: int, count: int, start: int = 0) -> list[str]:
    """`count` pieces of `chars` characters, each starting at a line."""
    out = []
    at = start
    while len(out) < count:
        at = text.find("\n", at) + 1
        if at <= 0 or at + chars > len(text):
            at = 0
            continue
        out.append(text[at : at + chars])
        at += chars
    return out


def workloads(
    text: str, tokens: int, chars_per_token: float, round_: int
) -> dict[str, list[dict[str, Any]]]:
    """The four workloads of round `round_`: its questions and turns are its own (new text
    in every round), the system prompt and the documents are the same in every round."""
    chars = int(tokens * chars_per_token)
    shared = cut(text, chars, 9)
    fresh = cut(text, chars, 50, start=(len(text) // 3 + round_ * 50 * chars) % len(text))
    questions = cut(text, 200, 250, start=(len(text) // 2 + round_ * 250 * 200) % len(text))
    system = shared[0]
    out: dict[str, list[dict[str, Any]]] = {
        "fresh": [{"prompt": p} for p in fresh],
        "system": [
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
            for q in questions[:100]
        ],
    }
    turns: list[dict[str, str]] = [{"role": "system", "content": system[: chars // 4]}]
    history = []
    for i in range(24):
        turns = [*turns, {"role": "user", "content": questions[100 + i]}]
        history.append({"messages": list(turns)})
        turns.append({"role": "assistant", "content": questions[124 + i]})
    out["history"] = history
    documents = shared[1:9]
    out["documents"] = [
        {"prompt": documents[i % 8] + "\nQuestion: " + questions[150 + i]} for i in range(100)
    ]
    return out


def measure(work: Callable[[], int], rounds: int) -> tuple[float, float, float]:
    """Median (min, max) CPU µs per 1,000 tokens of `work`, which returns its tokens."""
    per_k = []
    for _ in range(rounds):
        started = time.process_time()
        tokens = work()
        per_k.append((time.process_time() - started) / tokens * 1e9)
    return statistics.median(per_k), min(per_k), max(per_k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_DIR))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    args = parser.parse_args()
    tokenizer = load_tokenizers({MODEL: args.model_dir})[MODEL]
    counter = PromptCounter({MODEL: tokenizer})
    estimator = CostEstimator(AdmissionSettings())
    reference = tokenizer.reference
    text = source_text()
    sample = text[:200_000]
    ratio = len(sample) / len(reference.encode(sample, add_special_tokens=False).ids)
    rounds = [workloads(text, args.tokens, ratio, r) for r in range(args.rounds + 1)]
    print(f"# {tokenizer.describe()}; {ratio:.2f} characters a token in this text")
    print(
        "| workload | prompts | tokens each | kvgate, cold | kvgate, warm | tokenizers |"
        " tiktoken | estimate |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in rounds[0]:
        cells, prompts, each = row(counter, estimator, [r[name] for r in rounds], args.rounds)
        print(f"| {name} | {prompts} | {each} | " + " | ".join(cells) + " |")


def row(
    counter: PromptCounter,
    estimator: CostEstimator,
    loads: list[list[dict[str, Any]]],
    rounds: int,
) -> tuple[list[str], int, int]:
    """One workload's cells: each way's median (min-max) µs per 1,000 tokens; round 0 is
    the warm-up, rounds 1.. are timed, each with its own new text."""
    tokenizer = counter.tokenizers[MODEL]
    reference = tokenizer.reference
    texts = [
        [tokenizer.template.render(b) or "" if "messages" in b else b["prompt"] for b in bodies]
        for bodies in loads
    ]
    totals = [
        sum(len(reference.encode(t, add_special_tokens=False).ids) for t in ts) for ts in texts
    ]
    turn = iter(range(1, len(loads)))

    def kvgate(clear: bool) -> Callable[[], int]:
        def work() -> int:
            r = next(turn)
            if clear:
                tokenizer.segments.clear()
            for body in loads[r]:
                count = counter.local(MODEL, body, "messages" in body)
                assert count is not None
                estimator.price(estimator.basis(MODEL, body, 2048).with_count(count))
            return totals[r]

        return work

    def whole(encode: Callable[[str], Any]) -> Callable[[], int]:
        def work() -> int:
            r = next(turn)
            for text in texts[r]:
                encode(text)
            return totals[r]

        return work

    def estimate() -> int:
        r = next(turn)
        for body in loads[r]:
            estimator.price(estimator.basis(MODEL, body, 2048))
        return totals[r]

    ways: list[Callable[[], int]] = [
        kvgate(clear=True),
        kvgate(clear=False),
        whole(lambda t: reference.encode(t, add_special_tokens=False)),
        whole(tokenizer.segments._encode),
        estimate,
    ]
    cells = []
    for way in ways:
        if way is ways[1]:  # warm: the shared text seen once, as in a running gateway
            tokenizer.segments.clear()
            for body in loads[0]:
                counter.local(MODEL, body, "messages" in body)
        turn = iter(range(1, len(loads)))
        median, low, high = measure(way, rounds)
        cells.append(f"{median:.0f} ({low:.0f}-{high:.0f})")
    return cells, len(loads[1]), totals[1] // len(loads[1])


if __name__ == "__main__":
    main()
