"""Ollama's requests to plans: the ``GenerateParams`` a chat or a generation runs (Ollama's defaults for absent
options, every refused option a 400 naming it), the embedding tasks, the model ``/api/show`` asks about.
"""

from __future__ import annotations

import json
from typing import Any

from tether.errors import InvalidField
from tether.fleet.catalog import keep_alive_seconds
from tether.protocol import (
    MAX_TOKENS_LIMIT,
    ChatMessage,
    EmbedParams,
    GenerateParams,
)
from tether.serve.dialects import tools as toolkit
from tether.serve.dialects.conversation import ROLES, Call, Turn, is_role, latest_calls
from tether.serve.dialects.ollama.requests import (
    LOAD_TIME,
    MAX_STOPS,
    PENALTY_WINDOW,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaRequest,
    OllamaShowRequest,
)
from tether.serve.dialects.plan import Plan, embedding_tasks, schema_text
from tether.serve.dialects.shapes import declared_tools, thinking_of

DEFAULTS: dict[str, float | int] = {  # Ollama's documented defaults (docs/modelfile.md, api/types.go)
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "num_predict": -1,
}


def sampling(options: OllamaOptions | None) -> dict[str, Any]:
    """The ``GenerateParams`` fields ``options`` set, Ollama's defaults for the rest; a refused option is a 400."""
    o = options or OllamaOptions()
    for name, instance_option in LOAD_TIME.items():
        if getattr(o, name) is not None:
            how = f"the option {instance_option!r}" if instance_option else "the instance's options"
            raise InvalidField(
                f"options.{name}",
                f"options.{name} is a load-time option: Ollama loads a model per request's options, tether serves "
                f"instances started ahead, so it is an instance's option, set with {how} when the instance is "
                "started (POST /v1/instances); remove it from the request",
            )
    if o.num_keep is not None:
        raise InvalidField(
            "options.num_keep",
            "options.num_keep is not supported: there is no context shifting here (a generation ends with "
            "done_reason 'length' when its context is full); remove it",
        )
    limited: list[tuple[str, Any, Any, str]] = [
        ("repeat_last_n", o.repeat_last_n, PENALTY_WINDOW, "repeat_penalty looks back over the last 64 tokens"),
        ("typical_p", o.typical_p, 1.0, "typical sampling is not implemented: use top_p, top_k or min_p"),
        ("tfs_z", o.tfs_z, 1.0, "tail-free sampling is not implemented: use top_p, top_k or min_p"),
        ("mirostat", o.mirostat, 0, "mirostat sampling is not implemented: use top_p, top_k or min_p"),
        ("penalize_newline", o.penalize_newline, False, "newlines are never penalised here"),
    ]
    for name, value, only, why in limited:
        if value is not None and value != only:
            raise InvalidField(f"options.{name}", f"options.{name} must be {json.dumps(only)} or absent ({why})")
    predict = o.num_predict if o.num_predict is not None else -1
    if predict == -2:
        raise InvalidField(
            "options.num_predict",
            "options.num_predict -2 (fill the context) is not supported: send -1 (until the model stops or the "
            "context is full) or a number of tokens",
        )
    if predict == 0 or predict < -1:
        raise InvalidField(
            "options.num_predict", f"options.num_predict must be -1 or a number of tokens >= 1, got {predict}"
        )
    stops = [o.stop] if isinstance(o.stop, str) else list(o.stop or ())
    if len(stops) > MAX_STOPS:
        raise InvalidField("options.stop", f"options.stop takes at most {MAX_STOPS} strings, got {len(stops)}")
    return {
        # -1: the context bounds the generation (it ends "length" when full); the largest count the wire carries
        "max_tokens": MAX_TOKENS_LIMIT if predict == -1 else predict,
        "temperature": DEFAULTS["temperature"] if o.temperature is None else o.temperature,
        "top_p": DEFAULTS["top_p"] if o.top_p is None else o.top_p,
        "top_k": DEFAULTS["top_k"] if o.top_k is None else o.top_k,
        "min_p": DEFAULTS["min_p"] if o.min_p is None else o.min_p,
        "seed": None if o.seed == -1 else o.seed,
        "stop": tuple(stops),
        "repeat_penalty": DEFAULTS["repeat_penalty"] if o.repeat_penalty is None else o.repeat_penalty,
        "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0,
        "context": o.num_ctx,
    }


def format_schema(fmt: str | dict[str, Any] | None) -> str | None:
    """``format`` as ``GenerateParams.json_schema``: "json" is any JSON object, an object is a JSON Schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json" or fmt == {}:
        return '{"type": "object"}'
    if isinstance(fmt, str):
        raise InvalidField("format", f'format must be "json" or a JSON Schema object, got {fmt!r}')
    return schema_text(fmt, "format")


def _common(body: OllamaRequest) -> dict[str, Any]:
    """What chat and generate requests share: checks, then the sampling and logprobs fields."""
    keep_alive_seconds(body.keep_alive)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
    return {"logprobs": (body.top_logprobs or 0) if body.logprobs else None, **sampling(body.options)}


_OPTION_OF = {
    "max_tokens": "num_predict",
    **{name: name for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty")},
    **{name: name for name in ("presence_penalty", "frequency_penalty")},
    "context": "num_ctx",
}


def checked(params: GenerateParams) -> GenerateParams:
    """``params``, or the 400 for what is wrong with them, naming the option a request sets it with."""
    problem = params.check()
    if problem is None:
        return params
    option = _OPTION_OF.get(problem.field or "")
    if option is None:
        raise problem
    raise InvalidField(f"options.{option}", problem.why.replace(problem.field or "", f"options.{option}", 1))


def _empty(value: list[Any] | None, field: str, why: str) -> None:
    if value:
        raise InvalidField(field, f"{field} is not supported ({why}): remove it")


def chat_turns(messages: list[OllamaMessage]) -> list[Turn]:
    """Ollama's messages as the conversation: a call's arguments stay the object Ollama sends, and ``thinking`` is
    the turn's reasoning. Every message's role and images are checked before any message's calls."""
    turns = []
    for i, message in enumerate(messages):
        role = message.role
        if not is_role(role):
            raise InvalidField(
                f"messages[{i}].role",
                f"messages[{i}].role must be one of {', '.join(map(repr, ROLES))}, got {message.role!r}",
            )
        _empty(message.images, f"messages[{i}].images", "text models only")
        calls = tuple(Call(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or ())
        result = role == "tool"  # a tool's result: the call it answers, and the tool's name as the client gives it
        answers, tool = (message.tool_call_id, message.tool_name) if result else (None, None)
        reasoning = thinking_of(message.thinking, None, role, f"messages[{i}]", "thinking")
        turns.append(Turn(role, message.content, calls, answers=answers, tool=tool, reasoning=reasoning))
    for i, turn in enumerate(turns):
        if turn.calls and turn.role != "assistant":
            raise InvalidField(f"messages[{i}].tool_calls", f"messages[{i}]: only assistant turns carry tool_calls")
    return turns


def uses_tools(body: OllamaChatRequest) -> bool:
    """Whether the chat declares tools or carries earlier calls or results (its model's tool format matters)."""
    return bool(body.tools) or any(m.tool_calls or m.role == "tool" for m in body.messages or ())


def wants_thinking(body: OllamaRequest) -> bool | None:
    """``think`` as on, off or unsaid (a level, gpt-oss's way, is on: a template turns thinking on or off)."""
    return body.think if body.think is None or isinstance(body.think, bool) else True


def chat_plan(
    body: OllamaChatRequest, fmt: toolkit.ToolFormat = toolkit.GENERIC, thinking: bool | None = None
) -> Plan | None:
    """The chat's plan (``fmt``: the model's tool format; ``thinking``: ``GenerateParams.thinking``); None for a
    request without messages (Ollama's "load the model")."""
    common = _common(body)
    json_schema = format_schema(body.format)
    tools = toolkit.plan(declared_tools(body.tools), None, None, fmt)
    if not body.messages:
        checked(GenerateParams(prompt="", **common))  # a load request's options are checked too
        if tools is not None:
            tools.apply([], json_schema, "format")  # and tools beside a format are refused there too
        return None
    turns = chat_turns(body.messages)
    messages = toolkit.engine_messages(turns, fmt)
    tools = toolkit.settle(tools, latest_calls(turns))
    syntax = None
    if tools is not None:
        json_schema, syntax = tools.apply(messages, json_schema, "format")
    params = GenerateParams(
        messages=tuple(messages),
        json_schema=json_schema,
        tool_syntax=syntax,
        thinking=thinking,
        fit_context=True,
        **common,
    )
    keep = keep_alive_seconds(body.keep_alive)
    return Plan(
        checked(params), model=body.model, stream=body.stream, logprobs=body.logprobs, tools=tools, keep_alive=keep
    )


def generate_plan(body: OllamaGenerateRequest, thinking: bool | None = None, templated: bool = True) -> Plan | None:
    """The generation's plan; None for a request without a prompt (Ollama's "load the model"). ``templated``: the
    model has a chat template; without one the prompt is read as written (Ollama's template is then
    ``{{ .Prompt }}``), after the system prompt and a blank line when one is given."""
    common = _common(body)
    json_schema = format_schema(body.format)
    if body.suffix:
        raise InvalidField("suffix", "suffix (fill-in-the-middle) is not supported: remove it")
    if body.template:
        raise InvalidField("template", "template is not supported: the model's own chat template renders the prompt")
    _empty(body.context, "context", "Ollama's deprecated token state: send the conversation to /api/chat")
    _empty(body.images, "images", "text models only")
    for name in ("width", "height", "steps"):
        if getattr(body, name) is not None:
            raise InvalidField(name, f"{name} is not supported (image generation): remove it")
    if body.raw and body.system:
        raise InvalidField("system", "raw sends the prompt as written: a system prompt cannot go with it")
    if not body.prompt:
        checked(GenerateParams(prompt="", **common))  # a load request's options are checked too
        return None
    if body.raw or not templated:
        prompt = f"{body.system}\n\n{body.prompt}" if body.system and not body.raw else body.prompt
        params = GenerateParams(prompt=prompt, json_schema=json_schema, **common)
    else:
        turns = [ChatMessage(role="system", content=body.system)] if body.system else []
        turns.append(ChatMessage(role="user", content=body.prompt))
        params = GenerateParams(
            messages=tuple(turns), json_schema=json_schema, thinking=thinking, fit_context=True, **common
        )
    keep = keep_alive_seconds(body.keep_alive)
    return Plan(checked(params), model=body.model, stream=body.stream, logprobs=body.logprobs, keep_alive=keep)


def embed_texts(body: OllamaEmbedRequest) -> list[str]:
    """The inputs to embed: an empty string is none, as in Ollama (which answers it with no vectors)."""
    if isinstance(body.input, str):
        return [body.input] if body.input else []
    return body.input


def embed_inputs(texts: list[str], body: OllamaEmbedRequest | OllamaEmbeddingsRequest) -> list[EmbedParams]:
    keep_alive_seconds(body.keep_alive)
    if body.options:
        name = next(iter(body.options))
        raise InvalidField(
            f"options.{name}",
            f"options.{name}: no option applies to an embedding (sampling ones do nothing, load-time ones are the "
            "instance's, set when it is started with POST /v1/instances): remove it",
        )
    cut = True  # Ollama's default: an input too long keeps its first n_ctx tokens
    if isinstance(body, OllamaEmbedRequest):
        if body.dimensions is not None:
            raise InvalidField("dimensions", "dimensions is not supported: the vector has the model's size")
        cut = body.truncate is not False
    return embedding_tasks(texts, fit_context=cut)


def show_model(body: OllamaShowRequest) -> str | None:
    """The model ``/api/show`` asks about (``name`` is Ollama's older field for it)."""
    if body.verbose:
        raise InvalidField("verbose", "verbose is not supported: the tokenizer's arrays are not read (omit it)")
    return body.model if body.model is not None else body.name
