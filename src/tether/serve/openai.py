"""OpenAI's wire format: request bodies in, completion objects and SSE chunks out, errors in OpenAI's shape.

Bodies are decoded with msgspec (typed, with the offending field named in the error) into structs that ignore fields
tether does not use (clients send many) but refuse the ones whose meaning it cannot honour (``n`` > 1, ``echo``,
tools) rather than silently answering something else.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from tether.errors import InvalidField
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    SEED_RANGE,
    TEMPERATURE_RANGE,
    Cause,
    ChatMessage,
    GenerateParams,
    documented,
)

DEFAULT_MAX_TOKENS = 512  # OpenAI's chat default is "until the context is full"; a bound keeps a request bounded
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for system instructions; chat templates know "system"
MAX_STOPS = 4  # OpenAI's limit


Tokens = Annotated[int, documented(minimum=1, maximum=MAX_TOKENS_LIMIT)]
Stops = str | Annotated[list[str], documented(maxItems=MAX_STOPS)]


class TextPart(msgspec.Struct):
    type: Annotated[str, documented(enum=["text"], description="only text parts are supported")]
    text: str | None = None


class MessageIn(msgspec.Struct):
    role: Annotated[str, documented(enum=[*ROLES, *ROLE_ALIASES])]
    content: str | list[TextPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct):
    type: Annotated[str, documented(enum=["text"], description="structured output is not supported yet")] = "text"


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Tokens | None = None
    temperature: Annotated[float, documented(minimum=TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])] = 1.0
    top_p: Annotated[float, documented(exclusiveMinimum=0, maximum=1)] = 1.0
    stop: Stops | None = None
    seed: Annotated[int, documented(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1] - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, documented(enum=[1], description="one runner generates one choice per request")] = 1
    user: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: Annotated[list[MessageIn], documented(minItems=1)]
    max_completion_tokens: Tokens | None = None
    tools: Annotated[list[Any], documented(maxItems=0, description="tools are not supported yet")] | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | Annotated[list[str], documented(minItems=1, maxItems=1)]
    echo: Annotated[bool, documented(enum=[False], description="echo is not supported")] = False
    suffix: Annotated[str, documented(maxLength=0, description="suffix is not supported")] | None = None


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)

T = TypeVar("T")


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes, what: str = "request") -> T:
    """Decode a request body with ``decoder``; every way a body can be bad is an ``InvalidField`` (a 400, never a 500).

    msgspec refuses invalid UTF-8, lone surrogates, NaN and Infinity (not JSON), and numbers out of a field's
    range; nesting deeper than the interpreter's recursion limit surfaces as ``RecursionError``, caught here too.
    """
    try:
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as exc:
            if not re.search(r"Expected `int[^`]*`, got `float`", str(exc)):
                raise
            # JSON has one number type: 1.0 is the integer 1 (JSON Schema agrees), and clients that compute a
            # count send it so. Only integral floats become ints; 1.5 for an integer field still fails below.
            converted: T = msgspec.convert(_integral(msgspec.json.decode(body)), decoder.type)
            return converted
    except msgspec.ValidationError as exc:  # "Expected `float`, got `str` - at `$.temperature`"
        param = str(exc).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(exc) else None
        raise InvalidField(param, f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidField(None, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidField(
            None,
            f"the body nests arrays or objects too deeply to decode (the limit is about {sys.getrecursionlimit()} "
            "levels): flatten it",
        ) from None


def _integral(value: Any) -> Any:
    """``value`` (decoded JSON) with every float that holds an integer made an int (iteratively: no depth limit)."""
    root = [value]
    stack: list[list[Any] | dict[str, Any]] = [root]
    while stack:
        node = stack.pop()
        for key, item in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(item, float) and item.is_integer():
                node[key] = int(item)  # type: ignore[index]
            elif isinstance(item, list | dict):
                stack.append(item)
    return root[0]


def decode(kind: Literal["chat", "completion"], body: bytes) -> ChatRequest | CompletionRequest:
    if kind == "chat":
        return decode_body(_chat_decoder, body)
    return decode_body(_completion_decoder, body)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOPS:
        raise InvalidField("stop", f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}")
    return tuple(stops)


def _common(request: _Sampling, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    if request.n != 1:
        raise InvalidField("n", f"n must be 1 (one runner generates one choice per request), got {request.n}")
    return {
        "max_tokens": default_max if max_tokens is None else max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stop": _stops(request.stop),
        "seed": request.seed,
    }


def _checked(params: GenerateParams) -> GenerateParams:
    problem = params.check()
    if problem is not None:
        raise problem
    return params


def chat_params(request: ChatRequest) -> GenerateParams:
    if request.tools:
        raise InvalidField("tools", "tools are not supported by this server")
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidField("response_format", "response_format other than 'text' is not supported by this server")
    if not request.messages:
        raise InvalidField("messages", "messages must hold at least one message")
    messages = []
    for i, message in enumerate(request.messages):
        role = ROLE_ALIASES.get(message.role, message.role)
        if role in ("tool", "function"):
            raise InvalidField(
                f"messages[{i}].role",
                f"messages[{i}].role {message.role!r} answers a tool call, and tools are not supported by this server",
            )
        if role not in ROLES:
            raise InvalidField(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(repr(r) for r in (*ROLES, *ROLE_ALIASES))}, "
                f"got {message.role!r}",
            )
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InvalidField(f"messages[{i}].content", f"messages[{i}]: only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        messages.append(ChatMessage(role=role, content=content or ""))
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return _checked(GenerateParams(messages=tuple(messages), **_common(request, max_tokens, DEFAULT_MAX_TOKENS)))


def completion_params(request: CompletionRequest) -> GenerateParams:
    if request.echo:
        raise InvalidField("echo", "echo is not supported by this server")
    if request.suffix:
        raise InvalidField("suffix", "suffix is not supported by this server")
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise InvalidField("prompt", f"prompt must be one string (got a list of {len(prompt)})")
        prompt = prompt[0]
    return _checked(
        GenerateParams(prompt=prompt, **_common(request, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS))
    )


# --------------------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------------------

_encode = msgspec.json.Encoder().encode


def error_body(message: str, type_: str, *, code: str | None = None, param: str | None = None, **extra: Any) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` (extra keys for tether's causes)."""
    return _encode({"error": {"message": message, "type": type_, "param": param, "code": code, **extra}})


def cause_json(cause: Cause) -> dict[str, Any]:
    return {
        "kind": cause.kind.value,
        "summary": cause.summary,
        "evidence": list(cause.evidence),
        "phase": cause.phase,
        "exit_code": cause.exit_code,
        "signal": cause.signal,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Shaper:
    """Builds one request's response objects (chat or completion), sharing its id, creation time and model."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())

    def chunk(self, text: str, finish_reason: str | None = None, *, first: bool = False) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": text} if text or not finish_reason else {}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        return self._sse(
            {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        )

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._sse(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            obj = "text_completion"
        return _encode(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )

    @staticmethod
    def error_event(message: str, type_: str, code: str | None = None, **extra: Any) -> bytes:
        """An SSE event the openai client raises as an ``APIError``: the stream ends with it, never with [DONE]."""
        return b"data: " + error_body(message, type_, code=code, **extra) + b"\n\n"

    @staticmethod
    def _sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
