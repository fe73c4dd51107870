"""Counting prompts as the engine counts them, for the core's cost estimator.

- `counting.py`: `PromptCounter`, the order of the ways to count (the model's tokenizer,
  the engine's `/tokenize`, else the estimate) and the check of tokenizers against the
  engines' `usage`;
- `files.py`: the tokenizers named in `admission.tokenizers`, read at startup;
- `model.py`: one model's tokenizer applied as the engine applies it (special tokens,
  chat template);
- `template.py`: chat templates rendered as `transformers` and vLLM render them;
- `bpe.py`: byte-level BPE converted to `tiktoken`, the fast path, used where it agrees;
- `segments.py`: the ids of repeated text remembered;
- `engine.py`: vLLM's `/tokenize`, asked where no tokenizer is.
"""
