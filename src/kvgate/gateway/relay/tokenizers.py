"""The tokenizers named in `admission.tokenizers`, read once when the gateway is built.

A `tokenizer.json` gives the cost estimator exact prompt counts for its model. Reading one
is file I/O (and a large file takes a while to parse), so the shell does it at startup and
hands the loaded tokenizers to the core's estimator; a missing file or a missing
`tokenizers` package stops the start with a message naming the model and the path, rather
than failing the first request for that model.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.core.cost import Tokenizer


class TokenizerLoadError(ValueError):
    """A configured tokenizer cannot be read."""


def load_tokenizers(paths: Mapping[str, str]) -> dict[str, Tokenizer]:
    """Model name -> tokenizer, read from each model's `tokenizer.json`."""
    if not paths:
        return {}
    try:
        from tokenizers import Tokenizer as HfTokenizer  # optional dependency
    except ImportError:
        raise TokenizerLoadError(
            "admission.tokenizers needs the `tokenizers` package: pip install 'kvgate[tokenizers]'"
        ) from None
    loaded: dict[str, Tokenizer] = {}
    for model, path in paths.items():
        try:
            loaded[model] = HfTokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises a bare Exception for a bad file
            raise TokenizerLoadError(
                f"admission.tokenizers: cannot read {path!r} for model {model!r}: {exc}"
            ) from None
    return loaded
