"""The tokenizers named in `admission.tokenizers`, read once when the gateway is built.

Each entry names a model and where its tokenizer is: a model directory (the one the engine
loads, or a copy of its tokenizer files) holding `tokenizer.json` and, for chats,
`tokenizer_config.json` with its `chat_template` (or a `chat_template.jinja` or
`chat_template.json` beside it, which win, as in `transformers`); or the path of a
`tokenizer.json` alone, which counts completions' prompts but leaves chats to the engine's
count or the estimate. Reading them is file I/O (and a large vocabulary takes a while to
parse and to validate its fast path), so the shell does it at startup; a missing file, one
that does not parse, a template that does not compile or a missing package stops the start
with a message naming the model and the path, rather than failing the first request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate.gateway.tokens.model import ModelTokenizer, special_ids
from kvgate.gateway.tokens.template import ChatTemplate, TemplateError

log = logging.getLogger(__name__)

#: The special tokens a chat template is given, by their `tokenizer_config.json` names.
_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class TokenizerLoadError(ValueError):
    """A configured tokenizer cannot be read."""


def load_tokenizers(paths: Mapping[str, str]) -> dict[str, ModelTokenizer]:
    """Model name -> its tokenizer, read from each configured directory or file."""
    if not paths:
        return {}
    try:
        from tokenizers import Tokenizer as HfTokenizer  # optional dependency
    except ImportError:
        raise TokenizerLoadError(
            "admission.tokenizers needs the `tokenizers` package: pip install 'kvgate[tokenizers]'"
        ) from None
    loaded: dict[str, ModelTokenizer] = {}
    for model, path in paths.items():
        try:
            loaded[model] = _load(Path(path), HfTokenizer)
        except TokenizerLoadError as exc:
            raise TokenizerLoadError(
                f"admission.tokenizers: cannot read {path!r} for model {model!r}: {exc}"
            ) from None
        log.info("tokenizer for %s: %s (%s)", model, path, loaded[model].describe())
    return loaded


def _load(path: Path, loader: Any) -> ModelTokenizer:
    folder = path if path.is_dir() else None
    file = path / "tokenizer.json" if folder is not None else path
    if not file.is_file():
        what = "no tokenizer.json in the directory" if folder else "no such file"
        raise TokenizerLoadError(what)
    try:
        raw = file.read_text(encoding="utf-8")
        spec = json.loads(raw)
        reference = loader.from_str(raw)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerLoadError(f"{file.name} does not parse: {exc}") from None
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise TokenizerLoadError(f"{file.name} does not parse: {exc}") from None
    if not isinstance(spec, dict):
        raise TokenizerLoadError(f"{file.name} is not a JSON object")
    config = _read_json(folder / "tokenizer_config.json") if folder else {}
    template = _template(folder, config) if folder else None
    return ModelTokenizer(reference, spec, template, special_ids(reference, config))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerLoadError(f"{path.name} does not parse: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path.name} is not a JSON object")
    return data


def _template(folder: Path, config: Mapping[str, Any]) -> ChatTemplate | None:
    """The model's chat template, compiled, or None when it has none."""
    source: Any = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            source = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerLoadError(f"{jinja.name} cannot be read: {exc}") from None
    else:
        source = _read_json(folder / "chat_template.json").get("chat_template")
        if source is None:
            source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise TokenizerLoadError("the chat template is not a string")
    special: dict[str, str] = {}
    for name in _SPECIAL:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    try:
        return ChatTemplate(source, special)
    except TemplateError as exc:
        raise TokenizerLoadError(str(exc)) from None
