"""What the simulated engine reads of an OpenAI request: its prompt length and options.

Prompt length comes from the request: token ids count one each, text counts
`len(text) / chars_per_token` (a chat message adds the tokens its template's role markers
take), so a 32k-token prompt is cheap to send. `prompt_ids` gives the ids of that many
tokens, as the server's `/tokenize` answers them: token ids as sent, a text token's id a
hash of its characters (the same text, the same ids). A completion without `max_tokens`
generates `COMPLETION_DEFAULT_TOKENS`, as vLLM's do (its chats run to the end of the
context). An invalid request raises `BadRequest`, which the server answers with an
OpenAI-style error.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

_CHAT_TOKENS_PER_MESSAGE = 4  # role markers and separators a chat template adds
#: What vLLM's `/v1/completions` generates when `max_tokens` is absent (OpenAI's default).
COMPLETION_DEFAULT_TOKENS = 16
#: The simulated vocabulary's size: text token ids are below it.
VOCAB = 32000


class BadRequest(Exception):
    """An invalid request: answered with an OpenAI-style 400 (or the given status)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the engine needs of one request."""

    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    priority: int


def check_model(body: dict[str, Any], model_name: str) -> None:
    """Refuse (404) a request for another model than the one served."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)


def completion_request(
    body: dict[str, Any], chars_per_token: float, max_model_len: int
) -> ParsedRequest:
    """A `/v1/completions` body; without `max_tokens` it generates 16 tokens, fewer where
    the context ends first (as vLLM clamps its default)."""
    parsed = _parse_common(body, _completion_prompt_tokens(body.get("prompt"), chars_per_token))
    if parsed.max_tokens is None:
        room = max(1, max_model_len - parsed.prompt_tokens)
        parsed = dataclasses.replace(parsed, max_tokens=min(COMPLETION_DEFAULT_TOKENS, room))
    return parsed


def chat_request(body: dict[str, Any], chars_per_token: float) -> ParsedRequest:
    """A `/v1/chat/completions` body."""
    return _parse_common(body, _chat_prompt_tokens(body.get("messages"), chars_per_token))


def prompt_ids(body: dict[str, Any], chars_per_token: float) -> list[int]:
    """The ids of the tokens the engine counts for a completion or chat body (`/tokenize`):
    as many as `completion_request` or `chat_request` count. Raises `BadRequest`."""
    if "messages" in body:
        _chat_prompt_tokens(body.get("messages"), chars_per_token)  # validates
        ids: list[int] = []
        for message in body["messages"]:
            role = str(message.get("role"))
            ids += [_text_id(f"<|{role}|>{i}") for i in range(_CHAT_TOKENS_PER_MESSAGE)]
            ids += _text_ids(_content_text(message.get("content")), chars_per_token)
        return ids
    prompt = body.get("prompt")
    _completion_prompt_tokens(prompt, chars_per_token)  # validates
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text_ids(prompt, chars_per_token)
    return [int(t) for t in prompt or ()]


def _text_ids(text: str, chars_per_token: float) -> list[int]:
    count = _text_tokens(text, chars_per_token)
    cut = [min(len(text), math.floor(i * chars_per_token)) for i in range(count + 1)]
    cut[-1] = len(text)
    return [_text_id(text[cut[i] : cut[i + 1]]) for i in range(count)]


def _text_id(piece: str) -> int:
    return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % VOCAB


def _text_tokens(text: str, chars_per_token: float) -> int:
    return max(1, math.ceil(len(text) / chars_per_token)) if text else 0


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(t for t in texts if isinstance(t, str))
    return content if isinstance(content, str) else ""


def _completion_prompt_tokens(prompt: Any, chars_per_token: float) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt, chars_per_token)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return _completion_prompt_tokens(prompt[0], chars_per_token)
        raise BadRequest("the simulator serves one prompt per request", "prompt")
    raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")


def _chat_prompt_tokens(messages: Any, chars_per_token: float) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    total = 0
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("each message needs a role and content", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest("message content must be a string or parts", "messages")
        total += _text_tokens(_content_text(content), chars_per_token) + _CHAT_TOKENS_PER_MESSAGE
    return total


def _parse_common(body: dict[str, Any], prompt_tokens: int) -> ParsedRequest:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise BadRequest("max_tokens must be a positive integer", "max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("the simulator supports only n=1", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise BadRequest("priority must be an integer", "priority")
    return ParsedRequest(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        ignore_eos=bool(body.get("ignore_eos", False)),
        priority=priority,
    )


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body, a JSON object (else 400; 413 past the server's body size limit)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest("the request body is too large", status=413) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
