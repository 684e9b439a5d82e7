"""Request bodies of the OpenAI endpoints, checked into one :class:`GenerationRequest`.

Types are checked strictly (``"5"`` is not a number), unknown fields are refused and options this
server cannot honour (n > 1, logprobs, tools, penalties, ...) are refused rather than silently
ignored: a client relying on them would otherwise get output it did not ask for. Every refusal is
an :class:`APIError` with one sentence, rendered in OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, Literal

from attrs import frozen
from pydantic import BaseModel, ConfigDict, ValidationError

from dspark.types import SamplingParams

__all__ = ["APIError", "CompletionBody", "ChatBody", "GenerationRequest", "parse_body", "error_json"]


class APIError(Exception):
    """A refused request: HTTP ``status`` and one sentence, in OpenAI's error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def to_json(self) -> dict[str, Any]:
        return error_json(self.message, self.kind, self.param, self.code)


def error_json(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM's); 0 or -1: off
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


@frozen
class GenerationRequest:
    """What the engine needs from a body: ``prompt`` is text, token ids or chat messages."""

    model: str
    prompt: str | list[int] | list[dict[str, str]]
    chat: bool
    max_tokens: int | None  # None: up to the context window
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool


def _validation_sentence(err: ValidationError) -> APIError:
    e = err.errors()[0]
    loc = [str(x) for x in e["loc"]]
    param = loc[0] if loc else None
    if e["type"] == "missing":
        where = ".".join(loc)
        return APIError(f"Missing required parameter '{where}'.", param=param)
    if e["type"] == "extra_forbidden":
        return APIError(f"Unrecognized request argument '{'.'.join(loc)}' (this server does not support it).",
                        param=param)
    if param == "messages" and len(loc) > 2:
        return APIError(f"Invalid value for 'messages[{loc[1]}].{loc[2]}': {e['msg'].lower()}.", param=param)
    if param == "prompt":
        return APIError("Invalid type for 'prompt': expected a string, a list of token ids or a list of one "
                        "string.", param=param)
    return APIError(f"Invalid type for '{param}': {e['msg'].lower()}.", param=param)


def _unsupported(body: _Body) -> None:
    """Refuse options set to anything but their no-op value."""
    checks = {
        "n": body.n not in (None, 1),
        "presence_penalty": body.presence_penalty not in (None, 0, 0.0),
        "frequency_penalty": body.frequency_penalty not in (None, 0, 0.0),
        "logit_bias": bool(body.logit_bias),
        "logprobs": body.logprobs not in (None, False),
    }
    if isinstance(body, CompletionBody):
        checks.update(echo=bool(body.echo), best_of=body.best_of not in (None, 1), suffix=body.suffix is not None)
    if isinstance(body, ChatBody):
        checks.update(top_logprobs=body.top_logprobs is not None, tools=bool(body.tools),
                      tool_choice=body.tool_choice not in (None, "none"),
                      response_format=body.response_format not in (None, {"type": "text"}))
    for name, bad in checks.items():
        if bad:
            what = "n > 1" if name == "n" else f"'{name}'"
            return_msg = f"This server does not support {what}; generate one completion per request without it."
            raise APIError(return_msg, param=name)


def _chat_messages(body: ChatBody) -> list[dict[str, str]]:
    if not body.messages:
        raise APIError("'messages' must hold at least one message.", param="messages")
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"Only text content parts are supported (messages[{i}].content).", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content})
    return out


def parse_body(raw: Any, chat: bool) -> GenerationRequest:
    """A JSON body (already decoded) → :class:`GenerationRequest`, or :class:`APIError`."""
    if not isinstance(raw, dict):
        raise APIError("The request body must be a JSON object.")
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(raw)
    except ValidationError as err:
        raise _validation_sentence(err) from None
    _unsupported(body)
    if chat:
        prompt: Any = _chat_messages(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError("This server takes one prompt per request; send a list of several as separate "
                               "requests.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and len(prompt) == 0:
            raise APIError("'prompt' must not be empty.", param="prompt")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'max_tokens' must be at least 1, got {max_tokens}.", param="max_tokens")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0 <= temperature <= 2:
        raise APIError(f"'temperature' must lie in [0, 2], got {temperature}.", param="temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0 < top_p <= 1:
        raise APIError(f"'top_p' must lie in (0, 1], got {top_p}.", param="top_p")
    top_k = 0 if body.top_k in (None, -1) else body.top_k
    if top_k < 0:
        raise APIError(f"'top_k' must be 0 or -1 (off) or positive, got {top_k}.", param="top_k")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 4:
        raise APIError(f"'stop' holds at most 4 strings, got {len(stop)}.", param="stop")
    opts = body.stream_options or {}
    if set(opts) - {"include_usage"} or not isinstance(opts.get("include_usage", False), bool):
        raise APIError("'stream_options' supports only a boolean 'include_usage'.", param="stream_options")
    if opts and not body.stream:
        raise APIError("'stream_options' is only allowed with 'stream': true.", param="stream_options")
    return GenerationRequest(
        model=body.model, prompt=prompt, chat=chat, max_tokens=max_tokens,
        sampling=SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)),
        stop=stop, seed=None if body.seed is None else body.seed % 2**63, stream=bool(body.stream), include_usage=bool(opts.get("include_usage")))
