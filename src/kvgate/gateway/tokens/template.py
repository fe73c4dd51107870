"""A model's chat template, rendered as the engine renders it before tokenizing a chat.

vLLM renders chat messages with the Hugging Face chat template of the model
(`tokenizer_config.json`'s `chat_template`, or a `chat_template.jinja` beside it) the way
`transformers` does: jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, a `tojson` filter that keeps non-ASCII characters, the globals
`raise_exception` and `strftime_now`, the `{% generation %}` block of assistant-mask
templates, and as variables the messages, `add_generation_prompt` (true unless the request
says otherwise), `continue_final_message`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) and the request's `chat_template_kwargs`.

Only what is rendered the same for sure is rendered here: messages whose content is a
string (or absent) with no fields but `role`, `content` and `name`, and no `tools`,
`documents` or per-request `chat_template`. Anything else (content parts, tool calls,
images) is left to the engine's own count (`/tokenize`) or the estimate: `render` answers
None for it. A template that raises for a request (e.g. roles out of order) answers None too.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import Any

#: Message fields rendered here; a message with any other is left to the engine.
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
#: Request fields that change what the template receives in ways not reproduced here.
_UNSUPPORTED = ("tools", "functions", "documents", "chat_template", "mm_processor_kwargs")


class TemplateError(ValueError):
    """The chat template cannot be compiled."""


class ChatTemplate:
    """One model's compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise TemplateError(
                "chat templates need the `jinja2` package: pip install 'kvgate[tokenizers]'"
            ) from None

        class Generation(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`: rendered as its body."""

            tags = {"generation"}  # noqa: RUF012  (jinja2's own class attribute)

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[Generation, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        self._errors: tuple[type[BaseException], ...] = (jinja2.TemplateError, _Raised)
        self.special_tokens = dict(special_tokens)

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The prompt text the engine renders for a chat body, or None when this cannot
        promise to render it as the engine does (see the module docstring)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if any(body.get(key) is not None for key in _UNSUPPORTED):
            return None
        for message in messages:
            if not isinstance(message, dict) or not _MESSAGE_FIELDS.issuperset(message):
                return None
            content = message.get("content")
            if content is not None and not isinstance(content, str):
                return None
            if not isinstance(message.get("role"), str):
                return None
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            return None
        generation = body.get("add_generation_prompt", True)
        final = body.get("continue_final_message", False)
        if not isinstance(generation, bool) or not isinstance(final, bool):
            return None
        variables = {
            **self.special_tokens,
            **extra,
            "messages": messages,
            "add_generation_prompt": generation,
            "continue_final_message": final,
        }
        try:
            return str(self._template.render(variables))
        except self._errors:
            return None
        except Exception:  # a template's own arithmetic on odd input: not countable here
            return None


class _Raised(Exception):
    """`raise_exception(...)` inside a template."""


def _raise(message: str) -> None:
    raise _Raised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)
