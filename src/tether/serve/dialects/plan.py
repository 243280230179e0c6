"""What every dialect shares on the way in: a request body decoded (every way it can be bad is a 400 naming the
field, never a 500) and the ``Plan`` it becomes: the generation the runner gets and how its answer is shaped, or
the embedding tasks it becomes."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from tether.errors import InvalidField
from tether.protocol import EmbedParams, GenerateParams, Work
from tether.serve.dialects import tools as toolkit

T = TypeVar("T")
W = TypeVar("W", bound=Work)

DEFAULT_MAX_TOKENS = 512  # OpenAI's chat default is "until the context is full"; a bound keeps a request bounded
MAX_INPUTS = 2048  # OpenAI's limit on embedding inputs per request


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
        text = str(exc)
        at = text.rsplit("`$", 1)[-1].rstrip("`").lstrip(".") if "`$" in text else ""
        unknown = re.match(r"Object contains unknown field `([^`]*)`", text)
        if unknown:  # "Object contains unknown field `foo` - at `$.messages[0]`"
            param = f"{at}.{unknown[1]}" if at else unknown[1]
            raise InvalidField(
                param,
                f"invalid {what}: unknown field {param!r}. This server refuses fields it does not know rather than "
                "ignore them: correct or remove it (GET /openapi.json lists every field)",
            ) from None
        raise InvalidField(at or None, f"invalid {what}: {exc}") from None
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


@dataclass(frozen=True)
class Plan:
    """What one request asks for: the generation, and how its answer is shaped (every honoured field lands here)."""

    params: GenerateParams
    model: str | None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # render the tokens' logprobs in the answer
    tools: toolkit.ToolPlan | None = None
    keep_alive: float | None = None  # seconds the model stays loaded once idle (inf: forever); None: its default


def checked(params: W) -> W:
    """``params``, or the 400 for what is wrong with them."""
    problem = params.check()
    if problem is not None:
        raise problem
    return params


def schema_text(schema: dict[str, Any], field: str) -> str:
    """A JSON Schema as the JSON text ``GenerateParams.json_schema`` carries (the engine compiles it to a grammar)."""
    if not isinstance(schema, dict):
        raise InvalidField(field, f"{field} must be a JSON Schema object")
    return msgspec.json.encode(schema).decode()


def embedding_tasks(texts: list[str], *, fit_context: bool = False) -> list[EmbedParams]:
    """One embedding task per text (at most ``MAX_INPUTS``): what OpenAI's and Ollama's routes send the runner.
    ``fit_context``: a text longer than the instance's context keeps its first ``n_ctx`` tokens (Ollama's
    ``truncate``) instead of being refused."""
    if len(texts) > MAX_INPUTS:
        raise InvalidField("input", f"input takes at most {MAX_INPUTS} strings per request, got {len(texts)}")
    return [EmbedParams(prompt=text, fit_context=fit_context) for text in texts]
